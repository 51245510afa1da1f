"""`StepPlan`: what every layer of a group needs for one forward step, and how it is built.

A plan is made once per step by the group (on the CPU) and read by every layer: the slot of
each new token, the pages to copy before writing (copy-on-write), and how the rows' pages are
read: a strided view when the batch's pages form a regular slab, else a gather index, and the
live pages only when rows have holes (evicted pages) or the policy observes attention.
`place_rows` and `relocate_rows` choose page ids so that slabs stay regular while decoding.
A decode step reuses the last plan where it can: `continue_plan` when only the slots move,
`extend_plan` when rows lost pages to eviction and gained new ones (a bounded cache's step).
"""

from __future__ import annotations

import array
import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from .block_manager import EVICTED, BlockManager
from .kernels.arguments import mark_checked


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
    victims: np.ndarray | None = None  # long [B]: the live columns the next step recycles (`PageGroups.commit`)
    _on_device: dict = field(default_factory=dict)
    rows: list[list[int]] | None = None  # a copy of the rows as planned (`extend_plan`, `continue_plan` compare)
    _columns: "PlanColumns | None" = None  # the buffers `extend_plan` appends to, once it has extended this plan

    @property
    def kv_len(self) -> int:
        return self.num_tokens - self.first_pos

    def kernel_index(self, device: torch.device, num_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page_table [B, N], page_pos [B, N], q_pos [B, Q]) for the paged kernels, contiguous, once per
        device: int32 pages on CUDA (Triton), int64 on the CPU (the C kernel's type). The page ids are
        checked here, once per step and device, against pools of ``num_pages`` pages (the kernels
        read pools unchecked)."""
        key = ("kernel", device)
        index = self._on_device.get(key)
        if index is None:
            table, page_pos = self.live_pages()
            q_pos = torch.from_numpy(np.arange(self.past, self.num_tokens)[None].repeat(table.shape[0], axis=0))
            if device.type == "cuda":
                table = table.to(device, torch.int32)
            index = tuple(t.to(device).contiguous() for t in (table, page_pos, q_pos))
            mark_checked(*index, num_pages)
            self._on_device[key] = index
        return index

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
            moved = dataclasses.replace(self, table=move(self.table), slots=move(self.slots), copy_src=move(self.copy_src),
                                        copy_dst=move(self.copy_dst), read_table=move(self.read_table),
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


class PlanColumns:
    """Host buffers ``[B, capacity]`` behind a plan's ``table``, ``read_table`` and ``read_pos``, which
    `extend_plan` edits in place: evicted pages become holes, new pages' columns are appended (capacity
    doubles, like a vector). Plans extended from one another share them: each views its own first columns;
    only the newest plan is extended (an older one is finished). ``holes``: the live table's -1 entries."""

    def __init__(self, plan: StepPlan):
        self.widths = (plan.table.shape[1], plan.read_table.shape[1])
        self.buffers = [self._buffer(t.numpy()) for t in (plan.table, plan.read_table, plan.read_pos)]
        self.holes = int((plan.read_table == EVICTED).sum())
        self._live = None  # ((width, buffers), read_table, read_pos): the live tensors of the newest plan

    @staticmethod
    def _buffer(columns: np.ndarray, capacity: int = 0) -> np.ndarray:
        """``columns [B, n]`` at the start of a buffer with room for ``capacity`` (at least ``2 n``) columns."""
        B, n = columns.shape
        buffer = np.empty((B, max(capacity, 2 * n, 64)), dtype=np.int64)
        buffer[:, :n] = columns
        return buffer

    def extends(self, plan: StepPlan) -> bool:
        """``plan`` is the newest plan of these buffers."""
        return self.widths == (plan.table.shape[1], plan.read_table.shape[1])

    def drop(self, row: int, index: int, page: int) -> None:
        """Entry ``index`` of ``row`` (page ``page``) was evicted: a hole in both tables."""
        self.buffers[0][row, index] = EVICTED
        live = self.buffers[1][row, :self.widths[1]]
        live[live == page] = EVICTED
        self.holes += 1

    def append(self, pages: list[list[int]], positions: list[int], num_tokens: int):
        """Add ``pages[b]`` (first tokens at ``positions``) to every row; -> (table, read_table, read_pos)."""
        n, live = self.widths
        k = len(positions)
        for i, width in enumerate((n, live, live)):
            self._room(i, width + k)[:, width:width + k] = positions if i == 2 else pages
        self.widths = (n + k, live + k)
        return self._views(num_tokens)

    def recycle(self, entries: list[int], columns: list[int], pages: list[int], position: int, num_tokens: int):
        """Row b's logical entry ``entries[b]`` was evicted, but its page, at live column ``columns[b]``, now
        holds the tokens from ``position``: the logical table gets a hole there and the page at its end, the
        live table keeps its pages and the column's position changes; -> (table, read_table, read_pos)."""
        n, live = self.widths
        table, positions = self._room(0, n + 1), self.buffers[2]
        for b, (entry, column) in enumerate(zip(entries, columns)):  # (a few rows: scalar writes beat fancy indexing)
            table[b, entry] = EVICTED
            positions[b, column] = position
        table[:, n] = pages
        self.widths = (n + 1, live)
        return self._views(num_tokens)

    def _room(self, i: int, width: int) -> np.ndarray:
        """Buffer ``i``, grown (doubling) to hold ``width`` columns."""
        buffer = self.buffers[i]
        if width > buffer.shape[1]:
            self.buffers[i] = buffer = self._buffer(buffer[:, :self.widths[min(i, 1)]], 2 * width)
        return buffer

    def _views(self, num_tokens: int):
        """(table, read_table, read_pos) of the newest plan; holes and padding at ``num_tokens``, a position no
        query attends. The live tensors are the last plan's while the live table keeps its width and buffers (a
        page table keeps the mark of its ids' check, `mark_checked`: edits only turn ids into holes)."""
        n, live = self.widths
        key = (live, id(self.buffers[1]), id(self.buffers[2]))
        if self._live is None or self._live[0] != key:
            self._live = key, torch.from_numpy(self.buffers[1][:, :live]), torch.from_numpy(self.buffers[2][:, :live])
        if self.holes:
            positions = self.buffers[2][:, :live]
            positions[self.buffers[1][:, :live] == EVICTED] = num_tokens
        return torch.from_numpy(self.buffers[0][:, :n]), self._live[1], self._live[2]


def extend_plan(last: StepPlan | None, rows: list[list[int]], first_page: int, past: int, num_tokens: int,
                evicted: list[tuple[int, int]]) -> StepPlan | None:
    """The plan of a step whose rows, since ``last`` (read through live pages), only lost the pages at
    ``evicted`` (row, index) and gained fresh pages: ``last``'s tables edited in place (`PlanColumns`), where
    a full plan re-indexes every row. None when anything else changed (a trim, copy-on-write, shared rows, an
    edit it was not told of) or when holes fill 1/8 of the live table: plan in full (which packs them)."""
    if last is None or last.read_table is None or last.same_as is not None or last.num_tokens != past \
            or last.first_pos != first_page * last.page_size:
        return None
    S, n = last.page_size, last.table.shape[1]
    expected = [list(r) for r in last.rows]
    for b, i in evicted:
        if i >= n:
            return None
        expected[b][i] = EVICTED
    if [r[:n] for r in rows] != expected:
        return None
    columns = last._columns if last._columns is not None and last._columns.extends(last) else PlanColumns(last)
    if columns.holes + len(evicted) > last.read_table.numel() // 8:
        return None
    for b, i in evicted:
        columns.drop(b, i, last.rows[b][i])
    new = [r[n:] for r in rows]
    table, read_table, read_pos = columns.append(new, [(first_page + i) * S for i in range(n, n + len(new[0]))],
                                                 num_tokens)
    slots = torch.tensor([r[p // S - first_page] * S + p % S for r in rows for p in range(past, num_tokens)])
    return dataclasses.replace(last, q_len=num_tokens - past, past=past, num_tokens=num_tokens, table=table,
                               slots=slots, copy_src=None, copy_dst=None, read_table=read_table, read_pos=read_pos,
                               usage=None, shares=None, victims=None, rows=[list(r) for r in rows], _on_device={},
                               _columns=columns)


def recycle_plan(last: StepPlan, rows: list[list[int]], columns: list[int], entries: list[int], pages: list[int],
                 q_len: int) -> StepPlan:
    """The plan of a full pool's steady step (`GroupEviction.recycle`): row b's victim page ``pages[b]``, at live
    column ``columns[b]`` of ``last``'s plan and row entry ``entries[b]`` (already a hole), holds the row's ``q_len``
    new tokens: it is appended to the row. The live table keeps its width and pages, only that column's position
    changes: it stays free of holes, in no particular order (the kernels take any). ``last`` is finished: its copy
    of the rows becomes the new plan's."""
    for row, planned, entry, page in zip(rows, last.rows, entries, pages):
        row.append(page)
        planned[entry] = EVICTED
        planned.append(page)
    S, past = last.page_size, last.num_tokens
    plan_columns = last._columns if last._columns is not None and last._columns.extends(last) else PlanColumns(last)
    table, read_table, read_pos = plan_columns.recycle(entries, columns, pages, past, past + q_len)
    slots = np.array(pages) * S if q_len == 1 else (np.array(pages)[:, None] * S + np.arange(q_len)).reshape(-1)
    return StepPlan(last.batch_size, q_len, past, past + q_len, last.first_pos, table, torch.from_numpy(slots), None,
                    None, None, S, None, read_table, read_pos, rows=last.rows, _columns=plan_columns)


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
    Only unshared rows of an unbounded pool move (a shared page stays shared); the copies
    are appended to ``src``/``dst``, the pages left behind to ``replaced``. Returns whether
    they moved.
    """
    if manager.max_pages is not None or any(p == EVICTED or manager.ref[p] != 1 for r in rows for p in r):
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


def continue_plan(last: StepPlan | None, rows: list[list[int]], q_len: int, ref: list[int]) -> StepPlan | None:
    """The plan of the next step from ``last`` when nothing but the slots changes: the rows are those ``last``
    planned, and their ``q_len`` new tokens each fit in the row's last page, which no other row shares (no
    allocation, copy-on-write or trim). None when that does not hold: the step is then planned in full."""
    if last is None or last.same_as is not None:
        return None
    S, past = last.page_size, last.num_tokens
    if past % S == 0 or past % S + q_len > S or any(ref[r[-1]] != 1 for r in rows) or last.rows != rows:
        return None
    end, offsets = past + q_len, range(past % S, past % S + q_len)
    slots = torch.tensor([r[-1] * S + offset for r in rows for offset in offsets])
    read_pos = None if last.read_pos is None else last.read_pos.masked_fill(last.read_table == EVICTED, end)
    return dataclasses.replace(last, q_len=q_len, past=past, num_tokens=end, slots=slots, copy_src=None,
                               copy_dst=None, read_pos=read_pos, usage=None, shares=None, victims=None,
                               _on_device={})
