"""Which tokens of which requests the next continuous-batching step computes.

A step holds at most ``max_batch_tokens`` tokens: one for every decoding sequence first, then
prefill chunks of sequences still reading their prompt, then new sequences admitted in input order.
A sequence is admitted only when the pool can hold everything it may still need (its prompt and all
its new tokens, minus the pages it shares), so a running sequence never waits for a page and a
bounded pool never fails mid-run: admission waits instead.

Prefixes are computed once: a new sequence shares the cached pages of its prompt's leading full
pages (content hashes chained from the cache's fingerprint), and waits while another running
sequence is still computing the next of those pages. The samples of one prompt
(``num_return_sequences``) and the requests for an identical prompt are admitted together: one
sequence reads the prompt, the others fork from it (sharing every page) when it is done.

Invariants: ``reserved`` equals the sum over running sequences of the pages they may still allocate;
a sequence is in exactly one of ``waiting`` (via its request), ``running``, or finished.
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
    """One prompt and the sequences (samples) generated from it."""

    index: int  # position in the caller's prompt list
    prompt: list[int]
    max_new_tokens: int
    num_samples: int = 1
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of the prompt's full pages
    duplicates: list["Request"] = field(default_factory=list)  # later requests for the same prompt

    def total_pages(self, page_size: int) -> int:
        """Pages one sequence holds at the end if it generates all of ``max_new_tokens``."""
        return math.ceil((len(self.prompt) + self.max_new_tokens) / page_size)


@dataclass
class Sequence:
    """One generated sequence: output index, tokens fed to the model, tokens generated."""

    out_index: int
    request: Request
    tokens: list[int]  # prompt, then generated tokens as they are fed back
    computed: int = 0  # tokens whose keys/values are in the cache
    generated: list[int] = field(default_factory=list)
    reserve: int = 0  # pages this sequence may still allocate
    copy_reserved: bool = False  # ``reserve`` includes a copy of the shared partial page it was forked with
    hashed: int = 0  # leading full pages registered with the block manager
    followers: list["Sequence"] = field(default_factory=list)  # of the same prompt, forked after its prefill

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
        self.running: list[Sequence] = []
        self.reserved = 0
        self.computing: dict[bytes, Sequence] = {}  # hash of a prompt page -> the sequence computing it
        for r in requests:
            r.hashes = page_hashes(r.prompt, [1] * len(r.prompt), list(range(len(r.prompt))), self.S, 0, root)
        limit = cache.manager.max_pages
        for r in self.waiting:  # a prompt's sequences (samples, identical prompts) are admitted together
            if limit is not None and self.pages_for(r, 0) > limit:
                raise CacheUsageError(
                    f"prompt {r.index} and its {r.num_samples * (1 + len(r.duplicates)) - 1} other sequences (samples "
                    f"and identical prompts, which share its pages and start together) may need {self.pages_for(r, 0)} "
                    f"pages but max_pages={limit}: raise max_pages, or lower num_return_sequences or max_new_tokens.")

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def fork_pages(self, request: Request) -> int:
        """Pages a sequence forked after ``request``'s prompt may allocate (its partial page is copied on write)."""
        return request.total_pages(self.S) - len(request.prompt) // self.S

    def pages_for(self, request: Request, shared: int) -> int:
        """Worst case for ``request`` and its duplicates: every sequence runs to its ``max_new_tokens``."""
        forks = (request.num_samples - 1) * self.fork_pages(request)
        return request.total_pages(self.S) - shared + forks + sum(d.num_samples * self.fork_pages(d)
                                                                   for d in request.duplicates)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step: ``(sequence, number of new tokens)``, one-token sequences first; admits what fits."""
        step = [(seq, 1) for seq in self.running if not seq.prefilling]
        budget = self.max_batch_tokens - len(step)
        for seq in self.running:
            if seq.prefilling and budget > 0:
                step.append((seq, min(budget, len(seq.tokens) - seq.computed)))
                budget -= step[-1][1]
        skipped = deque()
        while self.waiting and budget > 0:
            request = self.waiting.popleft()
            seq = self._admit(request)
            if seq is None:
                skipped.append(request)
                if self.cache.manager.max_pages is not None and not self._waits_for_prefix(request):
                    break  # out of pages: later requests wait too (input order)
                continue
            step.append((seq, min(budget, len(seq.tokens) - seq.computed)))
            budget -= step[-1][1]
        self.waiting.extendleft(reversed(skipped))
        step.sort(key=lambda item: item[1] != 1)  # stable: one-token segments first
        return step

    def _waits_for_prefix(self, request: Request) -> bool:
        shared = len(self._cached_pages(request))
        return shared < len(request.hashes) and request.hashes[shared] in self.computing

    def _cached_pages(self, request: Request) -> list[int]:
        """The cached pages of the prompt's leading full pages (at least one prompt token is always computed)."""
        return self.cache.cached_prefix(request.hashes, (len(request.prompt) - 1) // self.S)

    def _admit(self, request: Request) -> Sequence | None:
        """A running sequence for ``request`` (its samples follow it), or None if it must wait."""
        if self._waits_for_prefix(request):
            return None
        manager = self.cache.manager
        shared = self._cached_pages(request)
        need = self.pages_for(request, len(shared)) + sum(manager.ref[p] == 0 for p in shared)
        if manager.available() - self.reserved < need:
            return None
        seqs = [Sequence(r.index * r.num_samples + j, r, list(r.prompt))
                for r in (request, *request.duplicates) for j in range(r.num_samples)]
        leader = seqs[0]
        self.cache.add_sequence(leader.out_index, shared, len(shared) * self.S)
        leader.computed, leader.hashed = len(shared) * self.S, len(shared)
        leader.followers = seqs[1:]
        leader.reserve = self.pages_for(request, len(shared))  # the followers' share moves to them at fork
        self.reserved += leader.reserve
        for h in request.hashes[len(shared):]:
            self.computing.setdefault(h, leader)
        self.running.append(leader)
        return leader

    # --------------------------------------------------------------- advance
    def plan(self, step: list[tuple[Sequence, int]]):
        """Plan ``step`` in the cache (pages come out of the sequences' reservations); returns the `RaggedStep`.

        A copy of a shared partial page is paid by a sequence that reserved one (`Sequence.copy_reserved`): the
        copier itself, else (the leader writing first) a sequence still holding the page after the step, whose own copy
        is then never needed (the last holder writes in place)."""
        new_tokens = [(seq.out_index, n) for seq, n in step]
        allocations = self.cache.step_pages(new_tokens)
        planned = self.cache.begin_step(new_tokens)
        for (seq, _), (pages, copied) in zip(step, allocations):
            if copied is not None:
                payer = seq if seq.copy_reserved else next(
                    (r for r in self.running if r.copy_reserved and copied in self.cache.sequences[r.out_index].pages),
                    seq)
                payer.copy_reserved = False
                payer.reserve -= 1
                pages -= 1
            seq.reserve -= pages
            self.reserved -= pages + (copied is not None)
        return planned

    def after_step(self, step: list[tuple[Sequence, int]]) -> None:
        """The step was computed: advance the sequences, make the step final (a cold format leaves the pages of the
        prompts still being read in float) and hash their newly full pages."""
        for seq, n in step:
            seq.computed += n
        self.cache.finish_step({seq.out_index for seq in self.running if seq.prefilling})
        for seq, _ in step:
            self._hash_full_pages(seq)

    def _hash_full_pages(self, seq: Sequence) -> None:
        full = seq.computed // self.S
        if full <= seq.hashed:
            return
        hashes = seq.request.hashes if full <= len(seq.request.hashes) else page_hashes(
            seq.tokens[:full * self.S], [1] * (full * self.S), list(range(full * self.S)), self.S, 0, self.root)
        self.cache.hash_pages(seq.out_index, hashes, seq.hashed, full, generated=full > len(seq.request.hashes))
        for content_hash in hashes[seq.hashed:full]:
            if self.computing.get(content_hash) is seq:
                del self.computing[content_hash]
        seq.hashed = full

    def fork_followers(self, leader: Sequence) -> list[Sequence]:
        """The leader read its prompt: its samples start from its pages (copy on write)."""
        followers, leader.followers = leader.followers, []
        for seq in followers:
            self.cache.fork_sequence(leader.out_index, seq.out_index)
            seq.computed, seq.hashed = leader.computed, leader.hashed
            seq.reserve = self.fork_pages(seq.request)
            seq.copy_reserved = len(seq.request.prompt) % self.S != 0
            leader.reserve -= seq.reserve
            self.running.append(seq)
        return followers

    def retire(self, seq: Sequence) -> None:
        """A finished sequence gives its pages back at once (hashed ones stay cached) and its reservation; retiring
        a sequence that is not running does nothing (retiring is idempotent)."""
        index = next((i for i, r in enumerate(self.running) if r is seq), None)
        if index is None:
            return
        del self.running[index]
        self.reserved -= seq.reserve
        seq.reserve = 0
        self.cache.release_sequence(seq.out_index)
        for h in [h for h, r in self.computing.items() if r is seq]:
            del self.computing[h]

    def check_invariants(self) -> None:
        """Assert the reservation invariants (between steps): ``reserved`` is the sum of the running sequences'
        reserves, which a bounded pool can provide; each sequence's reserve covers the pages it may still allocate
        (its followers' included), and the holders of a shared partial page reserved a copy for all but one."""
        manager, S = self.cache.manager, self.S
        assert self.reserved == sum(seq.reserve for seq in self.running), "reserved is not the sequences' sum"
        assert manager.max_pages is None or manager.available() >= self.reserved, "reserved more than the pool has"
        last_page = lambda r: -(-(len(r.prompt) + r.max_new_tokens) // S)  # noqa: E731 (not total_pages: checked)
        spare: dict[int, list[int]] = {}
        for seq in self.running:
            held = self.cache.sequences[seq.out_index]
            grow = last_page(seq.request) - len(held.pages) + sum(last_page(f.request) - len(f.request.prompt) // S
                                                                  for f in seq.followers)
            assert seq.reserve >= grow, f"sequence {seq.out_index} reserves {seq.reserve} of {grow} pages it may need"
            if held.length % S and manager.ref[held.pages[-1]] > 1:
                spare.setdefault(held.pages[-1], []).append(seq.reserve - grow)
        for page, copies in spare.items():
            assert sum(copies) >= len(copies) - 1, f"the holders of shared page {page} reserved too few copies"
