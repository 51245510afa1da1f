"""Which tokens of which requests the next continuous-batching step computes.

A step holds at most ``max_batch_tokens`` tokens: one for every decoding row first, then
prefill chunks of rows still reading their prompt, then new rows admitted in input order.
A row is admitted only when the pool can hold everything it may still need (its prompt and all
its new tokens, minus the pages it shares), so a running row never waits for a page and a
bounded pool never fails mid-run: admission waits instead.

Prefixes are computed once: a new row shares the cached pages of its prompt's leading full
pages (content hashes chained from the cache's fingerprint), and waits while another running
row is still computing the next of those pages. The samples of one prompt
(``num_return_sequences``) and the requests for an identical prompt are admitted together: one
row reads the prompt, the others fork from it (sharing every page) when it is done.

Invariants: ``reserved`` equals the sum over running rows of the pages they may still allocate;
a row is in exactly one of ``waiting`` (via its request), ``running``, or finished.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .errors import CacheUsageError
from .prefix_index import page_hashes
from .ragged_cache import RaggedCache


@dataclass
class Request:
    """One prompt and the rows (samples) generated from it."""

    index: int  # position in the caller's prompt list
    prompt: list[int]
    max_new_tokens: int
    num_rows: int = 1
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of the prompt's full pages
    duplicates: list["Request"] = field(default_factory=list)  # later requests for the same prompt

    def total_pages(self, page_size: int) -> int:
        """Pages one row holds at the end if it generates all of ``max_new_tokens``."""
        return math.ceil((len(self.prompt) + self.max_new_tokens) / page_size)


@dataclass
class Row:
    """One generated sequence: output index, tokens fed to the model, tokens generated."""

    out_index: int
    request: Request
    tokens: list[int]  # prompt, then generated tokens as they are fed back
    computed: int = 0  # tokens whose keys/values are in the cache
    generated: list[int] = field(default_factory=list)
    reserve: int = 0  # pages this row may still allocate
    copy_reserved: bool = False  # ``reserve`` includes a copy of the shared partial page it was forked with
    hashed: int = 0  # leading full pages registered with the block manager
    followers: list["Row"] = field(default_factory=list)  # rows of the same prompt, forked after its prefill

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.request.prompt)


class Scheduler:
    def __init__(self, cache: RaggedCache, requests: list[Request], max_batch_tokens: int, root: bytes):
        self.cache, self.max_batch_tokens, self.root = cache, max_batch_tokens, root
        self.S = cache.page_size
        first: dict[tuple[int, ...], Request] = {}
        for r in requests:  # an identical prompt is read once: its later requests fork from the first
            leader = first.setdefault(tuple(r.prompt), r)
            if leader is not r:
                leader.duplicates.append(r)
        self.waiting = deque(r for r in requests if first[tuple(r.prompt)] is r)
        self.running: list[Row] = []
        self.reserved = 0
        self.computing: dict[bytes, Row] = {}  # hash of a prompt page -> the row computing it
        for r in requests:
            r.hashes = page_hashes(r.prompt, [1] * len(r.prompt), list(range(len(r.prompt))), self.S, 0, root)
        limit = cache.manager.max_pages
        for r in self.waiting:  # a prompt's rows (samples, identical prompts) are admitted together
            if limit is not None and self.pages_for(r, 0) > limit:
                raise CacheUsageError(
                    f"prompt {r.index} and its {r.num_rows * (1 + len(r.duplicates)) - 1} other rows (samples and "
                    f"identical prompts, which share its pages and start together) may need {self.pages_for(r, 0)} "
                    f"pages but max_pages={limit}: raise max_pages, or lower num_return_sequences or max_new_tokens.")

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def fork_pages(self, request: Request) -> int:
        """Pages a row forked after ``request``'s prompt may allocate (its partial page is copied on write)."""
        return request.total_pages(self.S) - len(request.prompt) // self.S

    def pages_for(self, request: Request, shared: int) -> int:
        """Worst case for ``request`` and its duplicates: every row runs to its ``max_new_tokens``."""
        forks = (request.num_rows - 1) * self.fork_pages(request)
        return request.total_pages(self.S) - shared + forks + sum(d.num_rows * self.fork_pages(d)
                                                                   for d in request.duplicates)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> list[tuple[Row, int]]:
        """The next step: ``(row, number of new tokens)``, one-token rows first; admits what fits."""
        step = [(row, 1) for row in self.running if not row.prefilling]
        budget = self.max_batch_tokens - len(step)
        for row in self.running:
            if row.prefilling and budget > 0:
                step.append((row, min(budget, len(row.tokens) - row.computed)))
                budget -= step[-1][1]
        skipped = deque()
        while self.waiting and budget > 0:
            request = self.waiting.popleft()
            row = self._admit(request)
            if row is None:
                skipped.append(request)
                if self.cache.manager.max_pages is not None and not self._waits_for_prefix(request):
                    break  # out of pages: later requests wait too (input order)
                continue
            step.append((row, min(budget, len(row.tokens) - row.computed)))
            budget -= step[-1][1]
        self.waiting.extendleft(reversed(skipped))
        step.sort(key=lambda item: item[1] != 1)  # stable: one-token segments first
        return step

    def _waits_for_prefix(self, request: Request) -> bool:
        shared = len(self._cached_pages(request))
        return shared < len(request.hashes) and request.hashes[shared] in self.computing

    def _cached_pages(self, request: Request) -> list[int]:
        """The cached pages of the prompt's leading full pages (at least one prompt token is always computed)."""
        return self.cache.prefix.cached_run(request.hashes, (len(request.prompt) - 1) // self.S)

    def _admit(self, request: Request) -> Row | None:
        """A running row for ``request`` (its samples follow it), or None if it must wait."""
        if self._waits_for_prefix(request):
            return None
        manager = self.cache.manager
        shared = self._cached_pages(request)
        need = self.pages_for(request, len(shared)) + sum(manager.ref[p] == 0 for p in shared)
        if manager.available() - self.reserved < need:
            return None
        rows = [Row(r.index * r.num_rows + j, r, list(r.prompt))
                for r in (request, *request.duplicates) for j in range(r.num_rows)]
        leader = rows[0]
        self.cache.add_sequence(leader.out_index, shared, len(shared) * self.S)
        leader.computed, leader.hashed = len(shared) * self.S, len(shared)
        leader.followers = rows[1:]
        leader.reserve = self.pages_for(request, len(shared))  # the followers' share moves to them at fork
        self.reserved += leader.reserve
        for h in request.hashes[len(shared):]:
            self.computing.setdefault(h, leader)
        self.running.append(leader)
        return leader

    # --------------------------------------------------------------- advance
    def plan(self, step: list[tuple[Row, int]]):
        """Plan ``step`` in the cache (pages come out of the rows' reservations); returns the `RaggedStep`.

        A copy of a shared partial page is paid by a row that reserved one (`Row.copy_reserved`): the copier
        itself, else (the leader writing first) a row still holding the page after the step, whose own copy
        is then never needed (the last holder writes in place)."""
        new_tokens = [(row.out_index, n) for row, n in step]
        allocations = self.cache.step_pages(new_tokens)
        planned = self.cache.begin_step(new_tokens)
        for (row, _), (pages, copied) in zip(step, allocations):
            if copied is not None:
                payer = row if row.copy_reserved else next(
                    (r for r in self.running if r.copy_reserved and copied in self.cache.sequences[r.out_index].pages),
                    row)
                payer.copy_reserved = False
                payer.reserve -= 1
                pages -= 1
            row.reserve -= pages
            self.reserved -= pages + (copied is not None)
        return planned

    def after_step(self, step: list[tuple[Row, int]]) -> None:
        """The step was computed: advance the rows and hash their newly full pages."""
        self.cache.finish_step()
        for row, n in step:
            row.computed += n
            self._hash_full_pages(row)

    def _hash_full_pages(self, row: Row) -> None:
        pages = self.cache.sequences[row.out_index].pages
        full = row.computed // self.S
        if full <= row.hashed:
            return
        hashes = row.request.hashes if full <= len(row.request.hashes) else page_hashes(
            row.tokens[:full * self.S], [1] * (full * self.S), list(range(full * self.S)), self.S, 0, self.root)
        self.cache.prefix.register_pages(pages, hashes, 0, row.hashed, full, generated=full > len(row.request.hashes))
        for content_hash in hashes[row.hashed:full]:
            if self.computing.get(content_hash) is row:
                del self.computing[content_hash]
        row.hashed = full

    def fork_followers(self, leader: Row) -> list[Row]:
        """The leader read its prompt: its samples start from its pages (copy on write)."""
        followers, leader.followers = leader.followers, []
        for row in followers:
            self.cache.fork_sequence(leader.out_index, row.out_index)
            row.computed, row.hashed = leader.computed, leader.hashed
            row.reserve = self.fork_pages(row.request)
            row.copy_reserved = len(row.request.prompt) % self.S != 0
            leader.reserve -= row.reserve
            self.running.append(row)
        return followers

    def retire(self, row: Row) -> None:
        """A finished row gives its pages back at once (hashed ones stay cached) and its reservation; retiring a
        row that is not running does nothing (retiring is idempotent)."""
        index = next((i for i, r in enumerate(self.running) if r is row), None)
        if index is None:
            return
        del self.running[index]
        self.reserved -= row.reserve
        row.reserve = 0
        self.cache.release_sequence(row.out_index)
        for h in [h for h, r in self.computing.items() if r is row]:
            del self.computing[h]

    def check_invariants(self) -> None:
        """Assert the reservation invariants (between steps): ``reserved`` is the sum of the running rows'
        reserves, which a bounded pool can provide; each row's reserve covers the pages it may still allocate
        (its followers' included), and the holders of a shared partial page reserved a copy for all but one."""
        manager, S = self.cache.manager, self.S
        assert self.reserved == sum(row.reserve for row in self.running), "reserved is not the rows' sum"
        assert manager.max_pages is None or manager.available() >= self.reserved, "reserved more than the pool has"
        last_page = lambda r: -(-(len(r.prompt) + r.max_new_tokens) // S)  # noqa: E731 (not total_pages: checked)
        spare: dict[int, list[int]] = {}
        for row in self.running:
            seq = self.cache.sequences[row.out_index]
            grow = last_page(row.request) - len(seq.pages) + sum(last_page(f.request) - len(f.request.prompt) // S
                                                                 for f in row.followers)
            assert row.reserve >= grow, f"row {row.out_index} reserves {row.reserve} of the {grow} pages it may need"
            if seq.length % S and manager.ref[seq.pages[-1]] > 1:
                spare.setdefault(seq.pages[-1], []).append(row.reserve - grow)
        for page, copies in spare.items():
            assert sum(copies) >= len(copies) - 1, f"the holders of shared page {page} reserved too few copies"
