"""`StepPlan`: what every layer of a group needs for one forward step, and how it is built.

A plan is made once per step by the group (on the CPU) and read by every layer: the slot of
each new token, the pages to copy before writing (copy-on-write), and how the rows' pages are
read: a strided view when the batch's pages form a regular slab, else a gather index, and the
live pages only when rows have holes (evicted pages) or the policy observes attention.
`place_rows` and `relocate_rows` choose page ids so that slabs stay regular while decoding.
A decode step reuses the last plan where it can: `continue_plan` when only the slots move (a bounded cache's
steps edit the last plan too: `hf_paged.eviction.extend_plan`, `recycle_plan`).
"""

from __future__ import annotations

import array
import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from .block_manager import EVICTED, BlockManager
from .page_tables import kernel_index, query_positions


@dataclass
class StepPlan:
    """What every layer of a group needs for one forward step; computed once, on the CPU."""

    batch_size: int
    q_len: int
    past: int  # tokens cached before this step
    num_tokens: int  # tokens cached after this step
    first_pos: int  # logical position of the first token still held (same for every row)
    table: torch.Tensor  # long [B, N]: the rows' pages, logical order
    slots: torch.Tensor  # long [B * q_len]: flat slot (page * S + offset) of each new token
    copy_src: torch.Tensor | None  # long [C]: pages to copy before writing (copy-on-write)
    copy_dst: torch.Tensor | None
    slab: tuple[int, int] | None  # (first page, row stride in pages) when rows form a regular slab
    page_size: int = 1
    same_as: list[int] | None = None  # rows assumed identical to an earlier row (sharing its pages)
    read_table: torch.Tensor | None = None  # long [B, Nk]: live pages only (-1 padded), when rows have holes
    read_pos: torch.Tensor | None = None  # long [B, Nk]: logical position of each live page's first token
    usage: torch.Tensor | None = None  # float [B, Nk]: attention mass per live page this step, summed over layers
    shares: np.ndarray | None = None  # float64 [B, Nk]: the live pages' shares of ``usage``, recorded (inf: holes)
    victims: np.ndarray | None = None  # long [B]: the live columns the next step recycles (`record_together`); [B, k]:
    # the next k steps' (`EvictionPolicy.victim_queue`)
    _on_device: dict = field(default_factory=dict)
    rows: list[list[int]] | None = None  # a copy of the rows as planned (`extend_plan`, `continue_plan` compare)
    _columns: object = None  # the `eviction.PlanColumns` `extend_plan` appends to, once it has extended this plan
    packed = False  # (a class constant) rows of one batch, not sequences packed into one row (`RaggedStep`)
    usage_out = None  # float32 [B, Nk]: where a kernel may write this step's usage (`eviction.PlanStack` sets it on
    # the plans it makes, `UsageProbe.into`; not a field: copies, `but` or `dataclasses.replace`, do not keep it)

    @property
    def kv_len(self) -> int:
        return self.num_tokens - self.first_pos

    def but(self, **changes) -> "StepPlan":
        """A copy with ``changes`` (`dataclasses.replace` without its per-field work: a decode step of a bounded
        cache makes one per layer group)."""
        plan = object.__new__(StepPlan)
        plan.__dict__ = {**self.__dict__, "usage_out": None, **changes}
        return plan

    def kernel_index(self, device: torch.device, num_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page_table [B, N], page_pos [B, N], q_pos [B, Q]) of the live pages (`page_tables.kernel_index`)."""
        return kernel_index(self._on_device, device, num_pages, self._kernel_rows)

    def _kernel_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        table, page_pos = self.live_pages()
        return table, page_pos, query_positions(table.shape[0], self.past, self.num_tokens - self.past)

    def live_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages [B, Nk], first-token positions [B, Nk]) of the rows' live pages, -1 padded."""
        if self.read_table is not None:
            return self.read_table, self.read_pos
        B, N = self.table.shape
        return self.table, (self.first_pos + torch.arange(N) * self.page_size).expand(B, N)

    def add_usage(self, page_mass: torch.Tensor) -> None:
        """Add one layer's attention mass per live page [B, Nk] to this step's usage."""
        page_mass = page_mass.float()  # stays on its device: moved to the host once, at commit
        self.usage = page_mass if self.usage is None else self.usage + page_mass.to(self.usage.device)

    def on(self, device: torch.device) -> "StepPlan":
        """This plan's index tensors on ``device``, moved once per step per device."""
        if device.type == "cpu":
            return self
        moved = self._on_device.get(device)
        if moved is None:
            move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
            moved = dataclasses.replace(self, table=move(self.table), slots=move(self.slots),
                                        copy_src=move(self.copy_src), copy_dst=move(self.copy_dst),
                                        read_table=move(self.read_table),
                                        read_pos=move(self.read_pos), usage=None, shares=None, victims=None,
                                        _on_device={})
            self._on_device[device] = moved
        return moved


def page_table(rows: list[list[int]]) -> torch.Tensor:
    """Equal-length rows of page ids as a long tensor ``[B, N]``, through a buffer (a few times faster than
    `torch.tensor` on the thousand-entry rows of one-token pages)."""
    flat = array.array("q", itertools.chain.from_iterable(rows))
    if not flat:
        return torch.zeros(len(rows), 0, dtype=torch.long)
    return torch.frombuffer(flat, dtype=torch.long).clone().view(len(rows), -1)


def build_plan(rows: list[list[int]], first_page: int, past: int, num_tokens: int, page_size: int,
               src: list[int], dst: list[int], same_as: list[int] | None, live_read: bool) -> StepPlan:
    """The plan of a step that wrote tokens ``[past, num_tokens)`` into ``rows`` (logical pages from
    ``first_page``); the live pages are indexed when ``live_read`` or when a row has holes."""
    S = page_size
    table = page_table(rows)
    pos = torch.arange(past, num_tokens)
    slots = (table[:, pos // S - first_page] * S + pos % S).reshape(-1)
    read_table = read_pos = None
    live = table != EVICTED
    if live_read or not bool(live.all()):
        width = int(live.sum(1).max()) if table.numel() else 0
        order = torch.sort((~live).to(torch.int8), dim=1, stable=True).indices[:, :width]  # live first, in order
        read_table = table.gather(1, order)  # a shorter row is padded with its own holes: EVICTED entries
        read_pos = ((first_page + order) * S).masked_fill(read_table == EVICTED, num_tokens)
    return StepPlan(
        len(rows), num_tokens - past, past, num_tokens, first_page * S, table, slots,
        torch.tensor(src, dtype=torch.long) if src else None,
        torch.tensor(dst, dtype=torch.long) if dst else None,
        _slab(table) if read_table is None else None, S, same_as, read_table, read_pos, rows=[list(r) for r in rows],
    )


def _slab(table: torch.Tensor) -> tuple[int, int] | None:
    """(base, stride) if ``table[b, i] == base + b * stride + i`` for all rows, else None."""
    B, n = table.shape
    if n == 0:
        return None
    if n > 1 and not bool((table[:, 1:] - table[:, :-1] == 1).all()):
        return None
    base = int(table[0, 0])
    if B == 1:
        return base, n
    stride = int(table[1, 0]) - base
    if stride < n or not bool((table[:, 0] == base + stride * torch.arange(B)).all()):
        return None
    return base, stride


def place_rows(manager: BlockManager, rows: list[list[int]], count: int) -> None:
    """Give each row ``count`` more pages, keeping a row's pages consecutive when possible.

    A fresh batch of several rows is placed on a slab (row b starts at ``base + b * stride``,
    with 25% headroom per row), so that decode can keep growing each row into its own region.
    """
    if count <= 0:
        return
    if all(not r for r in rows):
        stride = count + (count // 4 + 1 if len(rows) > 1 else 0)
        base = manager.free_run(len(rows) * stride)
        if base is not None:
            for b, r in enumerate(rows):
                r.extend(manager.allocate(base + b * stride + i) for i in range(count))
            return
    for r in rows:
        for _ in range(count):
            r.append(manager.allocate(r[-1] + 1 if r else None))


def relocate_rows(manager: BlockManager, rows: list[list[int]], src: list[int], dst: list[int],
                  replaced: list[int]) -> bool:
    """Move rows that outgrew their slab region onto a new slab with 25% more room per row.

    Like a vector's growth: each move copies the cache once and adds 25% room, so the
    cost per token is amortised, and decode keeps reading views instead of gathering.
    Only unshared rows of an unbounded pool of one tier move (a shared page stays shared; a cold page,
    `hf_paged.demotion`, would be decoded by the copy); the copies are appended to ``src``/``dst``, the
    pages left behind to ``replaced``. Returns whether they moved.
    """
    if (manager.max_pages is not None or manager.cold is not None
            or any(p == EVICTED or manager.ref[p] != 1 for r in rows for p in r)):
        return False
    stride = len(rows[0]) + len(rows[0]) // 4 + 1
    base = manager.free_run(len(rows) * stride)
    if base is None:  # no free run, and the free and cached pages suffice: no growth for a move
        return False
    copied_from = dict(zip(dst, src))  # a page copied on write this step moves from its source
    for b, r in enumerate(rows):
        moved = [manager.allocate(base + b * stride + i) for i in range(len(r))]
        src.extend(copied_from.get(p, p) for p in r), dst.extend(moved)
        replaced.extend(r)
        r[:] = moved
    return True


def continues(last: StepPlan | None, rows: list[list[int]], q_len: int, ref: list[int]) -> bool:
    """The next step only moves the slots of ``last``'s plan (`continue_plan`): the rows are those it planned, and
    their ``q_len`` new tokens each fit in the row's last page, which no other row shares."""
    if last is None or last.same_as is not None:
        return False
    S, past = last.page_size, last.num_tokens
    return not (past % S == 0 or past % S + q_len > S or any(ref[r[-1]] != 1 for r in rows) or last.rows != rows)


def continue_plan(last: StepPlan | None, rows: list[list[int]], q_len: int, ref: list[int]) -> StepPlan | None:
    """The plan of the next step from ``last`` when nothing but the slots changes: the rows are those ``last``
    planned, and their ``q_len`` new tokens each fit in the row's last page, which no other row shares (no
    allocation, copy-on-write or trim). None when that does not hold: the step is then planned in full."""
    if not continues(last, rows, q_len, ref):
        return None
    S, past = last.page_size, last.num_tokens
    end, offsets = past + q_len, range(past % S, past % S + q_len)
    slots = torch.tensor([r[-1] * S + offset for r in rows for offset in offsets])
    read_pos = None if last.read_pos is None else last.read_pos.masked_fill(last.read_table == EVICTED, end)
    return last.but(q_len=q_len, past=past, num_tokens=end, slots=slots, copy_src=None, copy_dst=None,
                    read_pos=read_pos, usage=None, shares=None, victims=None, _on_device={})
