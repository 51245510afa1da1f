"""The C encoders of int4 and int2 pages (`hf_paged.kernels.cpu_page_codecs`) against the torch encoders of
`hf_paged.kv_formats`: bit-identical codes and parameters on awkward input (rounding ties, constant channels,
float8 steps below its smallest normal, float16's clamp), nothing written for non-finite input, and a
`QuantizedPages` fed step by step through them equal to one fed through torch."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import cpu_page_codecs
from hf_paged.kv_formats import PackedCodec, PageChannelCodec, QuantizedPages, page_format
from subprocess_checks import needs_cc

pytestmark = [needs_cc, pytest.mark.skipif(not cpu_page_codecs.available(), reason="the C encoders did not build")]


def same_key_params(a: torch.Tensor, b: torch.Tensor, dim: int) -> bool:
    """Page parameters equal: the minima as numbers (which of two equal zeros a minimum keeps is the reduction
    order's: -0.0 and 0.0 decode alike), the steps' bytes exactly."""
    return bool((a[..., :dim].float() == b[..., :dim].float()).all()) and torch.equal(
        a[..., dim:].contiguous().view(torch.uint8), b[..., dim:].contiguous().view(torch.uint8))


def awkward(shape, seed: int) -> torch.Tensor:
    """Normal values at mixed scales, with exact halves of small steps, repeated values and tiny ranges."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.tensor([1e-4, 0.01, 1.0, 30.0, 7e4])[
        torch.randint(0, 5, shape[:-1], generator=g)][..., None]
    halves = torch.randint(-64, 64, shape, generator=g).float() / 16
    pick = torch.randint(0, 4, shape, generator=g)
    return torch.where(pick == 0, halves, torch.where(pick == 1, x.round(), x))


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("S,H,D", [(16, 3, 64), (5, 2, 8), (1, 1, 4)])
def test_page_keys_match_the_torch_encoder(seed, S, H, D, bits):
    pages_held = 7
    residual = awkward((pages_held, S, H, D), seed)
    residual[0, :, 0, :3] = 0.25  # a constant channel: step 0
    g = torch.Generator().manual_seed(100 + seed)
    rows = torch.randperm(pages_held, generator=g)[:4].tolist()
    filled = torch.randint(1, S + 1, (4,), generator=g).tolist()
    pages = [9, 2, 5, 0]
    codes = torch.zeros(10, S, H, D * bits // 8, dtype=torch.uint8)
    params = torch.zeros(10, H, D + D // 2, dtype=torch.float16)
    new = awkward((2, H, D), 50 + seed)  # written into the residual first: row rows[0], slot filled[0] - 1
    assert cpu_page_codecs.encode_page_keys(new[:1], [rows[0] * S + filled[0] - 1], residual, rows, filled, pages,
                                            codes, params)
    assert torch.equal(residual[rows[0], filled[0] - 1], new[0])
    valid = torch.arange(S) < torch.tensor(filled)[:, None]
    want_codes, want_params = PageChannelCodec(bits).encode_pages(residual[rows], valid)
    assert torch.equal(codes[pages], want_codes)
    assert same_key_params(params[pages], want_params, D)
    untouched = [p for p in range(10) if p not in pages]
    assert not codes[untouched].any() and not params[untouched].view(torch.int16).any()


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("H,D", [(3, 64), (2, 12), (1, 4)])
def test_values_match_the_torch_encoder(seed, H, D, bits):
    rotated = awkward((9, H, D), seed)
    rotated[0, 0] = 0.0  # all zero: scale 0
    rotated[1, 0] = 3.0  # one value: the zero point's bound decides the scale
    slots = torch.tensor([17, 3, 0, 40, 8, 9, 22, 31, 1])
    codes = torch.zeros(8, 6, H, D * bits // 8 + 1, dtype=torch.uint8)
    scales = torch.zeros(8, 6, H, 1, dtype=torch.float16)
    assert cpu_page_codecs.encode_packed_values(rotated, slots, codes, scales)
    want_codes, want_scales = PackedCodec(None, bits=bits).encode(rotated, finite=True)
    assert torch.equal(codes.flatten(0, 1)[slots], want_codes)
    assert torch.equal(scales.flatten(0, 1)[slots].view(torch.int16), want_scales.view(torch.int16))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_value_writes_nothing(bad):
    keys = torch.randn(2, 4, 1, 8)
    keys[1, 2, 0, 5] = bad
    codes, params = torch.zeros(3, 4, 1, 4, dtype=torch.uint8), torch.zeros(3, 1, 12, dtype=torch.float16)
    none = torch.zeros(0, 1, 8)
    assert not cpu_page_codecs.encode_page_keys(none, [], keys, [0, 1], [4, 3], [0, 2], codes, params)
    assert not codes.any() and not params.view(torch.int16).any()
    keys[1, 3, 0, 5] = 1.0  # a slot after the filled ones holds no token: the rest is encoded
    keys[1, 2, 0, 5] = 1.0
    keys[1, 3, 0, 5] = bad
    assert cpu_page_codecs.encode_page_keys(none, [], keys, [0, 1], [4, 3], [0, 2], codes, params)
    values = torch.randn(3, 1, 8)
    values[2, 0, 0] = bad
    codes, scales = torch.zeros(2, 2, 1, 5, dtype=torch.uint8), torch.zeros(2, 2, 1, 1, dtype=torch.float16)
    assert not cpu_page_codecs.encode_packed_values(values, torch.tensor([0, 1, 2]), codes, scales)
    assert not codes.any() and not scales.view(torch.int16).any()


def _decode_writes(pages: QuantizedPages, steps: int, rows: int, seed: int) -> None:
    """A prompt of 5 tokens per row, then one token per row and step; the rows' pages are 2 r and 2 r + 1."""
    g = torch.Generator().manual_seed(seed)
    S = pages.page_size
    pages.grow_to(2 * rows + 2)
    prompt = torch.tensor([2 * r * S + i for r in range(rows) for i in range(5)])
    pages.write(prompt, torch.randn(len(prompt), 2, 8, generator=g), torch.randn(len(prompt), 2, 8, generator=g))
    for t in range(5, 5 + steps):
        slots = torch.tensor([(2 * r + t // S) * S + t % S for r in range(rows)])
        pages.write(slots, torch.randn(rows, 2, 8, generator=g), torch.randn(rows, 2, 8, generator=g))


@pytest.mark.parametrize("kv_format", ["int4", "int2"])
def test_quantized_pages_written_step_by_step_equal_the_torch_path(monkeypatch, kv_format):
    calls = []
    for name in cpu_page_codecs.SYMBOLS:
        encoder = getattr(cpu_page_codecs, name)
        monkeypatch.setattr(cpu_page_codecs, name, lambda *a, _f=encoder, _n=name: calls.append(_n) or _f(*a))
    fast = QuantizedPages(page_format(kv_format), 8, 2, 8, 8, torch.float32, "cpu")
    _decode_writes(fast, steps=9, rows=3, seed=0)
    assert set(calls) == set(cpu_page_codecs.SYMBOLS)  # every write went through the C encoders
    monkeypatch.setattr(cpu_page_codecs, "available", lambda: False)
    slow = QuantizedPages(page_format(kv_format), 8, 2, 8, 8, torch.float32, "cpu")
    _decode_writes(slow, steps=9, rows=3, seed=0)
    for name in ("k_codes", "v_codes", "v_scale"):
        assert torch.equal(getattr(fast, name).view(torch.uint8), getattr(slow, name).view(torch.uint8)), name
    assert same_key_params(fast.k_scale, slow.k_scale, 8)
    assert fast._residual_row.keys() == slow._residual_row.keys()
    for page, row in fast._residual_row.items():
        assert torch.equal(fast.k_residual[row], slow.k_residual[slow._residual_row[page]])
