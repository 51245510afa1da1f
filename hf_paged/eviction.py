"""Eviction policies: which of a row's live pages gives way when a bounded pool is full.

Order of what gives way (see `PageGroup.begin_step`): a free page, then the least recently
used cached (unreferenced) page, then, per policy, one of the row's own live pages:
- ``"score"``: the page with the lowest decayed attention score (H2O's heavy hitters with a
  decay, TOVA when ``decay=0``): each step adds the page's share of the attention of the step's
  last ``window`` queries, relative to an even share (1 = as much as an average live page), to an
  exponential moving average, bias-corrected for the steps the page has been observed;
- ``"lru"``: the page least recently *used*, where a page is used in a step when its share of the
  step's attention is at least ``threshold`` times an even share;
- ``"fifo"``: the oldest unprotected page (StreamingLLM: attention sinks + a recent window);
- ``"error"``: nothing is evicted; `PagePoolExhausted` is raised.
With ``compress_prompt``, a prompt larger than the bound is prefilled whole, then cut to the bound
by these scores, i.e. by the attention of the prompt's last ``window`` tokens (SnapKV): a question
at the end of a prompt steers what is kept. The attention share of a page is its mass averaged
over the observed queries and taken from the head that attends it most; by default each layer of
a bounded "score" or "lru" cache keeps its own pages and is its own group (``per_layer_eviction``),
otherwise the shares of a group's layers are summed. The first ``sink_pages`` logical pages and
the last ``recent_pages`` live pages (always including the page being written) are never
evicted. Evicted tokens are gone for every layer of the group; the positions of the kept tokens
never change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from .block_manager import EVICTED
from .errors import CacheUsageError

logger = logging.get_logger(__name__)
POLICIES = ("score", "lru", "fifo", "error")


DEFAULT_POLICY = "score"  # measured best in both regimes, streaming and compress-after-prefill (README, "Eviction")


@dataclass
class PageUsage:
    """What a group has observed of its pages' attention (keys: page ids, shared by forks).

    ``last_used[p]``: ``2 * step`` when written, ``2 * step + 1`` when used (so use outranks a write);
    ``ema[p]`` / ``observed[p]``: moving average of the relative share and how many steps fed it.
    """

    last_used: dict[int, int] = field(default_factory=dict)
    ema: dict[int, float] = field(default_factory=dict)
    observed: dict[int, int] = field(default_factory=dict)

    def allocated(self, pages: list[int], step: int) -> None:
        """Fresh pages (their first token written at ``step``) start with no history."""
        for page in pages:
            self.ema.pop(page, None)
            self.observed.pop(page, None)
            self.last_used[page] = 2 * step

    def written(self, pages: list[int], step: int) -> None:
        for page in pages:
            self.last_used[page] = 2 * step


@dataclass(frozen=True)
class EvictionPolicy:
    name: str = "lru"
    sink_pages: int = 1
    recent_pages: int = 1
    threshold: float = 1.0
    decay: float = 0.9
    window: int = 32
    compress_prompt: bool = False

    def __post_init__(self):
        if self.name not in POLICIES:
            raise CacheUsageError(f"eviction must be one of {POLICIES}, got {self.name!r}.")
        for name in ("sink_pages", "recent_pages", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "window" else 0):
                raise CacheUsageError(f"{name} must be a {'positive' if name == 'window' else 'non-negative'} "
                                      f"int, got {value!r}.")
        if not self.threshold > 0:
            raise CacheUsageError(f"lru_threshold must be a positive multiple of an even attention share, got "
                                  f"{self.threshold!r}.")
        if not 0.0 <= self.decay < 1.0:
            raise CacheUsageError(f"score_decay must be in [0, 1) (the weight of the past per step), got "
                                  f"{self.decay!r}.")

    @property
    def lossy(self) -> bool:
        return self.name != "error"

    @property
    def tracks_usage(self) -> bool:
        return self.name in ("score", "lru")

    @staticmethod
    def page_signal(page_mass: torch.Tensor) -> torch.Tensor:
        """One layer's attention mass per live page ``[B, H, Nk]`` (averaged over queries) -> ``[B, Nk]``: the
        largest over the heads, so that a page one head relies on counts as used (the pages are shared by
        every head; kvpress's presses choose per head)."""
        return page_mass.float().amax(dim=1)

    def record(self, usage: PageUsage, pages: torch.Tensor, mass: torch.Tensor, step: int) -> None:
        """Fold a step's attention mass ``[B, Nk]`` (summed over layers) on ``pages [B, Nk]`` into ``usage``.

        Plain Python on the host: a row holds tens of pages, where a torch op costs more than the loop."""
        for row_pages, row_mass in zip(pages.tolist(), mass.double().cpu().tolist()):
            live = [(page, value) for page, value in zip(row_pages, row_mass) if page != EVICTED]
            total = sum(value for _, value in live)
            even = total / len(live) if live else 0.0
            for page, value in live:
                relative = value / even if even > 0 else 0.0
                if self.name == "lru":
                    if relative >= self.threshold:
                        usage.last_used[page] = 2 * step + 1
                else:
                    usage.ema[page] = self.decay * usage.ema.get(page, 0.0) + (1 - self.decay) * relative
                    usage.observed[page] = usage.observed.get(page, 0) + 1

    def score(self, usage: PageUsage, page: int) -> float:
        """The page's bias-corrected moving average (1.0, an even share, before any observation)."""
        steps = usage.observed.get(page, 0)
        return usage.ema[page] / (1 - self.decay ** steps) if steps else 1.0

    def victim(self, row: list[int], first_page: int, usage: PageUsage) -> int | None:
        """Index in ``row`` of the page to evict, or None when every live page is protected."""
        live = [i for i, page in enumerate(row) if page != EVICTED]
        recent = set(live[-max(self.recent_pages, 1):])
        candidates = [i for i in live if first_page + i >= self.sink_pages and i not in recent]
        if not candidates:
            return None
        if self.name == "fifo":
            return candidates[0]
        if self.name == "lru":
            return min(candidates, key=lambda i: (usage.last_used.get(row[i], -1), i))
        return min(candidates, key=lambda i: (self.score(usage, row[i]), i))


def warn_first_eviction(policy: EvictionPolicy, max_pages: int) -> None:
    """Lossy eviction is logged once (per bound and policy)."""
    logger.warning_once(
        f"PagedCache(max_pages={max_pages}) is full: evicting pages with policy {policy.name!r} (lossy: evicted "
        "tokens are no longer attended). Raise max_pages, or use eviction='error' to fail instead.")


class GroupEviction:
    """A page group's side of eviction: its policy, the step clock, what was observed of its pages
    (`PageUsage`, shared with the group's forks) and the loop that picks victims row by row."""

    def __init__(self, policy: EvictionPolicy, bounded: bool, usage: PageUsage | None = None, clock: int = 0):
        self.policy = policy
        self.tracks_usage = policy.tracks_usage and bounded  # attention is observed only where pages can go
        self.usage = PageUsage() if usage is None else usage
        self.clock = clock  # steps planned so far
        self.evictions = 0  # live pages dropped
        self._compress_to: int | None = None  # the bound to cut to once a compressed prompt's step commits
        self.exact_tokens = math.inf  # tokens computed before the first eviction (they match a full forward)

    @property
    def compressing(self) -> bool:
        """A prompt over the bound was let in whole: it is cut when its step commits."""
        return self._compress_to is not None

    def fork(self, bounded: bool) -> "GroupEviction":
        """The eviction state of a forked group: same usage (by page id), clock and exactness, its own count."""
        twin = GroupEviction(self.policy, bounded, self.usage, self.clock)
        twin.exact_tokens = self.exact_tokens
        return twin

    def planned(self, plan) -> None:
        """A step was planned: advance the clock; pages it writes are recent, pages it starts are fresh."""
        self.clock += 1
        if plan.read_table is None:
            return
        pages, S = plan.slots // plan.page_size, plan.page_size
        self.usage.written(pages.unique().tolist(), self.clock)
        self.usage.allocated(pages[plan.slots % S == 0].unique().tolist(), self.clock)

    def sink(self, plan):
        """Where attention adds a layer's mass per live page ``[B, H, Nk]`` in ``plan``'s step, or None
        when the policy does not track usage (see `PagedView.usage`)."""
        if not self.tracks_usage:
            return None
        signal = self.policy.page_signal
        return lambda page_mass: plan.add_usage(signal(page_mass))

    def record(self, plan) -> None:
        """Hand the step's attention per page to the policy (once)."""
        if plan is None or plan.usage is None:
            return
        self.policy.record(self.usage, plan.read_table, plan.usage, self.clock)
        plan.usage = None

    def reserve(self, manager, rows: list[list[int]], first_page: int, num_tokens: int, needed: int,
                fresh: bool) -> None:
        """Make ``needed`` pages available for a step after ``num_tokens`` tokens, or raise `PagePoolExhausted`.
        With ``compress_prompt``, a fresh prompt over the bound goes in whole (cut at commit, see `committed`)."""
        if self.policy.compress_prompt and fresh and manager.max_pages is not None and needed > manager.available():
            self._compress_to, manager.max_pages = manager.max_pages, None
        elif self.policy.lossy and needed > manager.available():
            self.evict(manager, rows, first_page, num_tokens, needed)
        manager.require(needed, self.policy.lossy)

    def committed(self, manager, rows: list[list[int]], first_page: int, num_tokens: int) -> None:
        """After a prompt prefilled whole (``compress_prompt``): evict down to the bound, by the
        attention of the prompt's last queries; the pool keeps the prompt's size (its peak)."""
        if self._compress_to is not None:
            manager.max_pages, self._compress_to = self._compress_to, None
            self.evict(manager, rows, first_page, num_tokens, 0)

    def rolled_back(self, manager) -> None:
        """A compressed prompt's step was undone: nothing is held any more, only the bound comes back."""
        if self._compress_to is not None:
            manager.max_pages, self._compress_to = self._compress_to, None

    def evict(self, manager, rows: list[list[int]], first_page: int, num_tokens: int, needed: int) -> None:
        """Drop live pages per the policy, round-robin over rows, until ``needed`` pages are free."""
        warn_first_eviction(self.policy, manager.max_pages)
        self.exact_tokens = min(self.exact_tokens, num_tokens)  # later tokens see fewer: not reusable
        while manager.available() < needed:
            evicted = False
            for row in rows:
                i = self.policy.victim(row, first_page, self.usage)
                if i is None:
                    continue
                manager.release(row[i])
                row[i] = EVICTED
                self.evictions += 1
                evicted = True
                if manager.available() >= needed:
                    return
            if not evicted:
                return  # everything left is protected: `require` raises with the numbers
