"""`hf_paged.huge_pages`: tensors' memory moved onto 2 MB pages in place, never outside a tensor, values unchanged;
the packers call it on what they pack."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged import compiled_many, huge_pages
from hf_paged.huge_pages import HUGE_PAGE, move_to_huge_pages
from test_compile import fresh_dynamo  # noqa: F401 (a fixture)

MiB = 1 << 20


class RecordingLibc:
    """Stands in for libc: records each ``madvise(address, length, advice)`` and succeeds."""

    def __init__(self):
        self.calls = []

    def madvise(self, address, length, advice):
        self.calls.append((address, length, advice))
        return 0


@pytest.fixture
def libc(monkeypatch) -> RecordingLibc:
    recording = RecordingLibc()
    monkeypatch.setattr(huge_pages, "_LIBC", recording)
    return recording


def span(tensor: torch.Tensor) -> range:
    address, size = huge_pages._memory(tensor)
    return range(address, address + size)


def packed(rows: int, cols: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(torch.randn(rows, cols), 16)


@pytest.mark.parametrize("make", [lambda: torch.empty(9 * MiB, dtype=torch.uint8)[3:-5],
                                  lambda: torch.randn(MiB + 7), lambda: packed(2304, 1024)])
def test_only_whole_huge_pages_inside_the_tensor_are_advised(libc, make):
    """Every advised range is one aligned 2 MB page lying wholly inside the tensor's memory (hugepage, then collapse),
    and every such page is advised: the bytes reported are those pages."""
    tensor = make()
    inside = span(tensor)
    moved = move_to_huge_pages([tensor])
    pages = sorted({address for address, _, _ in libc.calls})
    want = [p for p in range(-(-inside.start // HUGE_PAGE) * HUGE_PAGE, inside.stop, HUGE_PAGE)
            if p + HUGE_PAGE <= inside.stop]
    assert pages == want and moved == len(want) * HUGE_PAGE and len(want) >= 1
    assert [advice for _, _, advice in libc.calls] == [huge_pages._MADV_HUGEPAGE, huge_pages._MADV_COLLAPSE] * len(want)
    assert all(length == HUGE_PAGE for _, length, _ in libc.calls)


def test_a_tensor_without_a_whole_huge_page_is_left_alone(libc):
    assert move_to_huge_pages([torch.randn(HUGE_PAGE // 8 - 1), torch.randn(3, 3)]) == 0 and libc.calls == []


def test_refused_pages_are_not_counted(monkeypatch):
    refusing = RecordingLibc()
    refusing.madvise = lambda address, length, advice: -1 if advice == huge_pages._MADV_COLLAPSE else 0
    monkeypatch.setattr(huge_pages, "_LIBC", refusing)
    assert move_to_huge_pages([torch.randn(4 * MiB)]) == 0


def anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    found = None
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and ":" not in first:
            low, high = (int(x, 16) for x in first.split("-"))
            found = low <= address < high
        elif found and first == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("make", [lambda: torch.randn(5 * MiB), lambda: packed(4096, 1536)])
def test_the_kernel_backs_the_memory_with_huge_pages_and_values_stay(make):
    """On a kernel that collapses (Linux >= 6.1 with transparent huge pages not "never"): the tensor's mapping holds at
    least the bytes moved on huge pages, and its values are bit for bit those before."""
    tensor = make()
    before = (tensor.to_dense() if tensor.is_mkldnn else tensor).clone()
    moved = move_to_huge_pages([tensor])
    if moved == 0:
        pytest.skip("this kernel moves no memory onto transparent huge pages (MADV_COLLAPSE refused)")
    assert anon_huge_bytes(-(-span(tensor).start // HUGE_PAGE) * HUGE_PAGE) >= HUGE_PAGE
    assert torch.equal(tensor.to_dense() if tensor.is_mkldnn else tensor, before)


def test_pack_linear_weights_puts_the_packed_copies_on_huge_pages(libc):
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2304), torch.nn.Linear(2304, 8))
    hf_paged.pack_linear_weights(model)
    big = model[0]._hf_paged_packed_weight.packed
    assert {address for address, _, _ in libc.calls} and all(
        address in span(big) for address, _, _ in libc.calls)
    x = torch.randn(5, 1024)
    hf_paged.unpack_linear_weights(model)
    assert torch.allclose(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias))


def test_a_call_that_compiles_moves_the_frozen_weights_and_steady_calls_do_not(fresh_dynamo, monkeypatch):
    moves = []
    monkeypatch.setattr(compiled_many, "packed_weights_to_huge_pages", lambda: moves.append(1) or 7)
    forward = compiled_many.SteadyForward(torch.compile(lambda x: x * 2, backend="eager", dynamic=True), {})
    forward(x=torch.ones(3))
    assert moves == [1] and forward.huge_page_bytes == 7
    forward(x=torch.ones(3))  # steady: the same graph
    forward(x=torch.ones(5))  # a new shape that the dynamic graph serves: nothing compiled
    assert moves == [1]
    forward(x=torch.ones(3, dtype=torch.int64))  # a new graph
    assert moves == [1, 1]
