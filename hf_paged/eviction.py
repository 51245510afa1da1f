"""Eviction policies: which of a row's live pages gives way when a bounded pool is full.

Order of what gives way (see `LayerGroup.begin_step`): a free page, then the least recently
used cached (unreferenced) page, then, per policy, one of the row's own live pages:
- ``"score"``: the page with the lowest decayed attention score (H2O's heavy hitters with a
  decay, TOVA when ``decay=0``): each step adds the page's share of the attention of the step's
  last ``observation_window`` queries, relative to an even share (1 = as much as an average live page), to an
  exponential moving average, bias-corrected for the steps the page has been observed;
- ``"lru"``: the page least recently *used*, where a page is used in a step when its share of the
  step's attention is at least ``threshold`` times an even share;
- ``"fifo"``: the oldest unprotected page (StreamingLLM: attention sinks + a recent window);
- ``"error"``: nothing is evicted; `PagePoolExhausted` is raised.
With ``compress_prompt``, a prompt larger than the bound is prefilled whole, then cut to the bound
by these scores, i.e. by the attention of the prompt's last ``observation_window`` tokens (SnapKV): a question
at the end of a prompt steers what is kept. The attention share of a page is its mass averaged
over the observed queries and over the heads, or taken from the head that attends it most; with
the ``"output"`` signal a page's usage is instead how far each head's output would move if the page
were dropped (``‖Σ_page a·v − A·o‖ / (1 − A)`` for the page's attention ``A`` and the head's output
``o``): a page that draws attention but holds values like the output's counts little
(`usage_signal_defaults` picks signal, observation window, decay and heads by page size, policy and regime). By
default each layer of a bounded "score" or "lru" cache keeps its own pages and is its own group
(``per_layer_eviction``), otherwise the shares of a group's layers are summed. The first ``sink_pages``
logical pages and the last ``recent_pages`` live pages (always including the page being written) are never
evicted. Evicted tokens are gone for every layer of the group; the positions of the kept tokens
never change.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass

import numpy as np
import torch
from transformers.utils import logging

from .block_manager import EVICTED
from .errors import CacheUsageError
from .kernels.reference import LEAVE_OUT_FLOOR
from .page_tables import query_positions, remember_kernel_index

logger = logging.get_logger(__name__)
HOST = torch.device("cpu")
POLICIES = ("score", "lru", "fifo", "error")
HEAD_REDUCTIONS = ("mean", "max")
SIGNALS = ("attention", "output")  # what a page's usage measures: its attention mass, or the output it moves


SINK_TOKENS = 4  # StreamingLLM keeps the first 4 tokens: attention sinks


def default_sink_pages(page_size: int) -> int:
    """Pages that hold the first `SINK_TOKENS` tokens."""
    return math.ceil(SINK_TOKENS / page_size)


def usage_signal_defaults(page_size: int, name: str = "score", compress_prompt: bool = False) -> dict:
    """The usage signal measured best for a page size (docs/eviction.md): a one-token page follows what
    the step's last query takes from it, averaged over heads (TOVA); a page of several tokens, whose tokens
    matter unevenly, a decayed average of its attention over a 32-query window from its most attentive head.
    What is taken is attention, except for a streaming "score" cache of one-token pages: the output each
    token moves. A compressed prompt is cut by its question's attention (SnapKV): the output signal lets go
    of repeated tokens while others like them remain, and a key to copy back (46866) loses a digit.
    ("lru" is defined on attention.)"""
    output = name == "score" and page_size == 1 and not compress_prompt
    if page_size == 1:
        return dict(decay=0.0, observation_window=1, heads="mean", signal="output" if output else "attention")
    return dict(decay=0.9, observation_window=32, heads="max", signal="attention")


# PagedCache's flat eviction keywords (in `for_pages` order) and their defaults (None: chosen by page size)
FLAT_DEFAULTS = dict(sink_pages=None, recent_pages=1, lru_threshold=1.0, score_decay=None, observation_window=None,
                     score_heads=None, compress_prompt=False, score_signal=None, eviction_interval=None)
DEFAULT_INTERVAL = 8  # victims of one-token pages ranked by their last share: as good, faster (docs/eviction.md)
DEFAULT_POLICY = "score"  # measured best in both regimes, streaming and compress-after-prefill (docs/eviction.md)


class PageHistory:
    """What a group has observed of its pages' attention, indexed by page id (shared by forks).

    ``last_used[p]``: ``2 * step`` when written, ``2 * step + 1`` when used (so use outranks a write);
    ``ema[p]`` / ``observed[p]``: moving average of the relative share and how many steps fed it.
    Host numpy arrays, grown with the largest page id seen: every layer of a decode step folds and
    ranks hundreds of pages, which numpy does in about a microsecond a call. ``replaced`` (one count for every
    history): how often some history's arrays were replaced (grown, or stacked), counted after each replacement.
    """

    replaced = 0

    def __init__(self):
        self.last_used = np.zeros(0, dtype=np.int64)
        self.ema = np.zeros(0, dtype=np.float64)
        self.observed = np.zeros(0, dtype=np.int64)

    def cover(self, pages: np.ndarray) -> None:
        """Grow the arrays so that every id in ``pages`` indexes them (new ids: no history)."""
        need = int(pages.max()) + 1 if pages.size else 0
        if need > len(self.ema):
            grow = max(need, 2 * len(self.ema), 64) - len(self.ema)
            self.last_used = np.concatenate([self.last_used, np.zeros(grow, dtype=np.int64)])
            self.ema = np.concatenate([self.ema, np.zeros(grow, dtype=np.float64)])
            self.observed = np.concatenate([self.observed, np.zeros(grow, dtype=np.int64)])
            PageHistory.replaced += 1

    def allocated(self, pages, step: int) -> None:
        """Fresh pages (their first token written at ``step``) start with no history."""
        self.written(pages, step, True)

    def written(self, pages, step: int, fresh: np.ndarray | bool | None = None) -> None:
        """``pages`` were written at ``step``; those where the mask ``fresh`` holds (True: all) start afresh."""
        index = _ids(pages)
        self.cover(index)
        self.last_used[index] = 2 * step
        if fresh is not None:
            start = index if fresh is True or fresh.all() else index[fresh]
            self.ema[start], self.observed[start] = 0.0, 0


def _ids(pages) -> np.ndarray:
    """Page ids (a list, tensor or array) as an int64 array (a tensor on the host is viewed, not copied)."""
    if isinstance(pages, torch.Tensor):  # (page ids never require grad)
        pages = pages.cpu().numpy()
        return pages if pages.dtype == np.int64 else pages.astype(np.int64)
    return np.asarray(pages, dtype=np.int64)


@dataclass(frozen=True)
class EvictionPolicy:
    name: str = "lru"
    sink_pages: int = 1
    recent_pages: int = 1
    threshold: float = 1.0
    decay: float = 0.9
    observation_window: int = 32
    compress_prompt: bool = False
    heads: str = "max"
    signal: str = "attention"
    interval: int = 1  # victims chosen every ``interval`` evictions of a stacked step, that many per row at once

    def __post_init__(self):
        if self.name not in POLICIES:
            raise CacheUsageError(f"eviction must be one of {POLICIES}, got {self.name!r}.")
        for name in ("sink_pages", "recent_pages", "observation_window", "interval"):
            value = getattr(self, name)
            least = 1 if name in ("observation_window", "interval") else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise CacheUsageError(f"{'eviction_interval' if name == 'interval' else name} must be a "
                                      f"{'positive' if least else 'non-negative'} int, got {value!r}.")
        if not self.threshold > 0:
            raise CacheUsageError(f"lru_threshold must be a positive multiple of an even attention share, got "
                                  f"{self.threshold!r}.")
        if self.heads not in HEAD_REDUCTIONS:
            raise CacheUsageError(f"score_heads must be one of {HEAD_REDUCTIONS}, got {self.heads!r}.")
        if self.signal not in SIGNALS:
            raise CacheUsageError(f"score_signal must be one of {SIGNALS}, got {self.signal!r}.")
        if self.signal == "output" and self.name == "lru":
            raise CacheUsageError("score_signal='output' needs eviction='score': 'lru' counts a page as used by its "
                                  "attention share (lru_threshold).")
        if not 0.0 <= self.decay < 1.0:
            raise CacheUsageError(f"score_decay must be in [0, 1) (the weight of the past per step), got "
                                  f"{self.decay!r}.")

    @classmethod
    def for_pages(cls, page_size: int, name: str | None = None, sink_pages: int | None = None, recent_pages: int = 1,
                  threshold: float = 1.0, decay: float | None = None, observation_window: int | None = None,
                  heads: str | None = None, compress_prompt: bool = False,
                  signal: str | None = None, interval: int | None = None) -> "EvictionPolicy":
        """A policy for pages of ``page_size`` tokens; what is None takes its default for that size (the
        default policy, the pages of the first `SINK_TOKENS` tokens as sinks, `usage_signal_defaults`, and
        `DEFAULT_INTERVAL` for a policy that ranks one-token pages by their last share, else 1)."""
        name = name or DEFAULT_POLICY
        defaults = usage_signal_defaults(page_size, name, compress_prompt)
        policy = cls(name, default_sink_pages(page_size) if sink_pages is None else sink_pages,
                     recent_pages, threshold, defaults["decay"] if decay is None else decay,
                     defaults["observation_window"] if observation_window is None else observation_window,
                     compress_prompt,
                     defaults["heads"] if heads is None else heads, defaults["signal"] if signal is None else signal,
                     1 if interval is None else interval)
        if interval is None and page_size == 1 and policy.ranks_by_last_share:
            return dataclasses.replace(policy, interval=DEFAULT_INTERVAL)
        return policy

    @classmethod
    def of(cls, page_size: int, eviction: "str | EvictionPolicy | None", *flat) -> "EvictionPolicy":
        """The policy of ``PagedCache(eviction=..., <the flat keywords, in `FLAT_DEFAULTS` order>)``: a policy given
        whole is taken as it is (the flat keywords must then keep their defaults); a name (None: the default) is made
        by `for_pages` from them."""
        if not isinstance(eviction, cls):
            policy = cls.for_pages(page_size, eviction, *flat)
        else:
            given = [name for (name, default), value in zip(FLAT_DEFAULTS.items(), flat) if value != default]
            if given:
                raise CacheUsageError(f"eviction={eviction!r} is a whole policy: set {', '.join(given)} in it, not "
                                      "beside it.")
            policy = eviction
        if policy.interval > 1 and page_size != 1:
            raise CacheUsageError(f"eviction_interval={policy.interval} queues victims of one-token pages: it needs "
                                  f"page_size=1, got {page_size}.")
        return policy

    @property
    def lossy(self) -> bool:
        return self.name != "error"

    @property
    def tracks_usage(self) -> bool:
        return self.name in ("score", "lru")

    def page_signal(self, page_mass: torch.Tensor) -> torch.Tensor:
        """One layer's usage per live page ``[B, H, Nk]`` (its attention mass, or the output it moves, averaged
        over the observed queries; `UsageProbe.signal`) -> ``[B, Nk]``: the
        heads' mean (``heads="mean"``, TOVA) or the largest over the heads (``"max"``: a page one head relies
        on counts as used; the pages are shared by every head). A ``[B, Nk]`` mass was reduced so by the
        kernel (`UsageProbe.heads`)."""
        page_mass = page_mass.float()
        if page_mass.dim() == 2:
            return page_mass
        return page_mass.mean(dim=1) if self.heads == "mean" else page_mass.amax(dim=1)

    def record(self, history: PageHistory, pages: torch.Tensor, mass: torch.Tensor, step: int) -> np.ndarray:
        """Fold a step's usage ``[B, Nk]`` (summed over layers) on ``pages [B, Nk]`` into ``history``;
        -> the pages' shares ``[B, Nk]``, relative to an even share of their row (inf at holes)."""
        pages = _ids(pages)
        shares = self.whole_shares(pages, mass)
        if shares is not None and self.fold_whole(history, pages, shares):
            return shares
        history.cover(pages)
        shares = mass.detach().cpu().numpy().astype(np.float64)
        for row_pages, row_shares in zip(pages, shares):  # (each row's mass becomes its shares in place)
            live = row_pages != EVICTED
            whole = live.all()
            ids = row_pages if whole else row_pages[live]
            even = float((row_shares if whole else row_shares[live]).sum()) / max(len(ids), 1)
            if even > 0:
                row_shares /= even
            else:
                row_shares[:] = 0.0
            if not whole:
                row_shares[~live] = np.inf
            relative = row_shares if whole else row_shares[live]
            if self.name == "lru":
                history.last_used[ids[relative >= self.threshold]] = 2 * step + 1
            else:  # (with no decay the average is the last share)
                decayed = self.decay * history.ema[ids] + (1 - self.decay) * relative if self.decay else relative
                history.ema[ids] = decayed
                history.observed[ids] += 1
        return shares

    @property
    def ranks_by_last_share(self) -> bool:
        """A page's rank is its share of the last step that observed it (a "score" with no decay: TOVA)."""
        return self.name == "score" and self.decay == 0

    def whole_shares(self, pages: np.ndarray, mass: torch.Tensor, whole: bool = False) -> np.ndarray | None:
        """`record`'s shares in one pass over the rows (the same numbers), for a "score" policy when no row has
        holes (``whole``: known to have none); else None."""
        if self.name != "score" or not pages.size or (not whole and (pages == EVICTED).any()):
            return None
        shares = mass.detach().cpu().numpy().astype(np.float64)
        even = shares.sum(axis=1, keepdims=True) / pages.shape[1]
        if (even > 0).all():
            shares /= even
            return shares
        np.divide(shares, even, out=shares, where=even > 0)
        shares[~(even[:, 0] > 0)] = 0.0  # a row whose mass sums to nothing (or NaN), as `record`'s rows
        return shares

    def fold_whole(self, history: PageHistory, pages: np.ndarray, shares: np.ndarray) -> bool:
        """Fold whole rows' shares (`whole_shares`) into the pages' moving averages in one pass, as `record`'s
        row loop does; False, changing nothing, when a decayed average would fold a page twice (rows share it)."""
        if not self.decay:
            self.fold_last_shares(history, pages, shares)
            return True
        if len(pages) > 1 and np.unique(pages).size != pages.size:
            return False
        history.cover(pages)
        history.ema[pages] = self.decay * history.ema[pages] + (1 - self.decay) * shares
        history.observed[pages] += 1
        return True

    @staticmethod
    def fold_last_shares(history: PageHistory, pages: np.ndarray, shares: np.ndarray) -> None:
        """The pages' last shares become their scores (`whole_shares`; a page in several rows: the last row's)."""
        history.cover(pages)
        history.ema[pages] = shares
        history.observed[pages] += 1

    def scores(self, history: PageHistory, pages) -> np.ndarray:
        """The pages' bias-corrected moving averages (1.0, an even share, before any observation)."""
        pages = _ids(pages)
        history.cover(pages)
        steps = history.observed[pages]
        unbiased = history.ema[pages]
        if self.decay > 0:  # (with no decay the average is the last share: nothing to correct)
            unbiased = unbiased / np.maximum(1 - self.decay ** steps.astype(np.float64), 1e-300)
        return np.where(steps > 0, unbiased, 1.0)

    def victims(self, row, first_page: int, history: PageHistory, count: int) -> list[int]:
        """Indices in ``row`` (page ids, a list or an array) of up to ``count`` pages to evict, in the order the
        policy gives them up (ties: the oldest first); fewer when the rest is protected. Equal to ``count``
        single picks: a pick changes no other page's rank, nor which pages are protected."""
        table = _ids(row)
        start = max(self.sink_pages - first_page, 0)  # the sinks' entries, if any are left, come first
        live = np.flatnonzero(table[start:] != EVICTED) + start
        candidates = live[:max(len(live) - max(self.recent_pages, 1), 0)]
        if self.name == "fifo" or not len(candidates):
            return candidates[:count].tolist()
        rank = self._rank(history, table[candidates])
        order = [int(np.argmin(rank))] if count == 1 else np.argsort(rank, kind="stable")[:count]  # first of ties
        return candidates[order].tolist()

    def _rank(self, history: PageHistory, pages: np.ndarray) -> np.ndarray:
        """The order in which a usage policy gives ``pages`` up (lowest first): when last used ("lru"), or
        the score."""
        if self.name == "lru":
            history.cover(pages)
            return history.last_used[pages].astype(np.float64)
        return self.scores(history, pages)

    def victim_columns(self, table: np.ndarray, positions: np.ndarray, history: PageHistory, page_size: int,
                       num_tokens: int, shares: np.ndarray | None = None) -> np.ndarray | None:
        """Per row of a live table (``table [B, Nk]``: page ids in any order, -1 for holes; ``positions``: each
        page's first token, ``num_tokens`` for holes) of rows holding ``num_tokens`` tokens, the column of the page
        `victims` would give up first: the lowest rank among the unprotected pages, ties to the oldest. None when
        a row has every page protected. ``shares``: the last step's shares of these columns (`record`), the ranks
        when the policy `ranks_by_last_share` (they are overwritten; ``table`` and ``history`` may then be None). The
        recent pages are the rows' last logical pages: never evicted, they are live."""
        rank = self._column_ranks(table, positions, history, page_size, num_tokens, shares)
        columns = rank.argmin(axis=1)
        best = rank[np.arange(len(rank)), columns][:, None]  # (the minimum: one pass fewer than min)
        if best.max() == np.inf:
            return None
        ties = rank == best
        if np.count_nonzero(ties) > len(rank):  # (rare) the oldest of the pages tied for lowest
            columns = np.where(ties, positions, np.iinfo(np.int64).max).argmin(axis=1)
        return columns

    def _column_ranks(self, table, positions: np.ndarray, history, page_size: int, num_tokens: int,
                      shares: np.ndarray | None) -> np.ndarray:
        """`victim_columns`' ranks of the live columns ``[B, Nk]``, inf where a page is protected (or a hole)."""
        if self.name == "fifo":
            rank = positions.astype(np.float64)
        else:  # (holes index some page's usage: they are protected below; the shares are used up)
            rank = shares if shares is not None and self.ranks_by_last_share else self._rank(history, table)
        recent_from = ((num_tokens - 1) // page_size + 1 - max(self.recent_pages, 1)) * page_size
        rank[(positions < self.sink_pages * page_size) | (positions >= recent_from)] = np.inf  # (holes: at num_tokens)
        return rank

    def victim_queue(self, table, positions: np.ndarray, history, page_size: int, num_tokens: int,
                     shares: np.ndarray | None = None) -> np.ndarray | None:
        """`victim_columns`, or with an ``interval`` k > 1 each row's k lowest-ranked unprotected columns ``[B, k]``
        (ties: the oldest first; the first column is `victim_columns`' pick), which the next k steps that a
        `PlanStack` recycles evict in turn (fewer columns when some row has fewer unprotected pages; None: none)."""
        if self.interval == 1:
            return self.victim_columns(table, positions, history, page_size, num_tokens, shares)
        rank = self._column_ranks(table, positions, history, page_size, num_tokens, shares)
        order = np.lexsort((positions, rank))[:, :self.interval]  # (by rank, then by age)
        picked = np.take_along_axis(rank, order, axis=1)
        count = int((picked < np.inf).sum(axis=1).min())
        return order[:, :count] if count else None

    def victim(self, row: list[int], first_page: int, history: PageHistory) -> int | None:
        """Index in ``row`` of the page to evict, or None when every live page is protected."""
        picked = self.victims(row, first_page, history, 1)
        return picked[0] if picked else None


def warn_first_eviction(policy: EvictionPolicy, max_pages: int) -> None:
    """Lossy eviction is logged once (per bound and policy)."""
    logger.warning_once(
        f"PagedCache(max_pages={max_pages}) is full: evicting pages with policy {policy.name!r} (lossy: evicted "
        "tokens are no longer attended). Raise max_pages, or use eviction='error' to fail instead.")


class UsageProbe:
    """What attention measures of one layer in one step (``plan``'s) for a ``policy`` that tracks usage: `report`
    takes the usage per live page ``[B, H, Nk]`` (averaged over the observed queries), or ``[B, Nk]`` when a kernel
    reduced it over the heads as ``heads`` says ("mean" or "max"); the step's last ``observed_queries`` queries are
    observed; ``signal``: a page's attention mass ("attention") or how far it moves each head's output ("output")."""

    __slots__ = ("plan", "policy", "observed_queries", "heads", "signal")

    def __init__(self, plan, policy: EvictionPolicy):
        self.plan, self.policy = plan, policy
        self.observed_queries, self.heads, self.signal = policy.observation_window, policy.heads, policy.signal

    def report(self, page_mass: torch.Tensor) -> None:
        self.plan.add_usage(self.policy.page_signal(page_mass))

    def into(self) -> torch.Tensor | None:
        """Where a kernel may write the ``[B, Nk]`` usage it then reports: the plan's row of its `PlanStack`'s usage
        (``usage_out``) while no layer reported this step (a group of several layers adds theirs), else None."""
        plan = self.plan
        return plan.usage_out if plan.usage is None else None


def page_usage(probs: torch.Tensor, out: torch.Tensor, values: torch.Tensor, page_size: int,
               signal: str) -> torch.Tensor:
    """Attention probabilities ``[B, Hkv, g, Q, T]`` of the observed queries over the live tokens, their outputs
    ``out [B, Q, Hq, D]`` and the tokens' ``values [B, T, Hkv, D]`` -> usage per live page ``[B, H, Nk]``, averaged
    over the queries: the page's attention ``A``, or with the "output" signal how far it moves each head's output
    ``o``, ``‖Σ a·v − A·o‖ / (1 − A)`` (kernels/reference.py), from dot products (no ``[.., Nk, D]``)."""
    B, Hkv, g, Q, T = probs.shape
    S = page_size
    per_page = probs.reshape(B, Hkv, g, Q, T // S, S)
    mass = per_page.sum(-1)  # [B, Hkv, g, Q, Nk]
    if signal == "output":
        v = values.float().transpose(1, 2)  # [B, Hkv, T, D]
        o = out.float().reshape(B, Q, Hkv, g, -1).permute(0, 2, 3, 1, 4)  # [B, Hkv, g, Q, D]
        v_dot_o = torch.matmul(o.reshape(B, Hkv, g * Q, -1), v.transpose(-1, -2)).reshape(B, Hkv, g, Q, T // S, S)
        v_gram = torch.matmul(v.reshape(B, Hkv, T // S, S, -1), v.reshape(B, Hkv, T // S, S, -1).transpose(-1, -2))
        moved_sq = torch.einsum("bhgqns,bhnst,bhgqnt->bhgqn", per_page, v_gram, per_page)  # ‖Σ a·v‖²
        moved_sq = moved_sq - 2 * mass * (per_page * v_dot_o).sum(-1) + mass ** 2 * (o * o).sum(-1)[..., None]
        mass = moved_sq.clamp(min=0).sqrt() / (1 - mass).clamp(min=LEAVE_OUT_FLOOR)
    return mass.mean(dim=3).reshape(B, Hkv * g, T // S)


class GroupEviction:
    """A page group's side of eviction: its policy, the step clock, what was observed of its pages
    (`PageHistory`, shared with the group's forks) and the loop that picks victims row by row."""

    def __init__(self, policy: EvictionPolicy, bounded: bool, history: PageHistory | None = None, clock: int = 0):
        self.policy = policy
        self.tracks_usage = policy.tracks_usage and bounded  # attention is observed only where pages can go
        self.history = PageHistory() if history is None else history
        self.clock = clock  # steps planned so far
        self.evictions = 0  # live pages dropped
        self.evicted: list[tuple[int, int]] = []  # (row, index in row) of the pages dropped since the last plan
        self.exact_tokens = math.inf  # tokens computed before the first eviction (they match a full forward)
        self._warned_for = None  # the bound the first eviction under it was logged for
        self.held_queue = None  # (past, q_len, pages, positions [B, n]): a rolled-back step's queue, for its retry

    def hold_queue(self, plan) -> None:
        """``plan``'s step is rolled back: keep the victims it queued for the steps after it
        (`EvictionPolicy.victim_queue`) as (page, position) pairs, since its retry may hold them in other columns
        (`planned`). Its own victim's eviction stands; the retry takes that free page instead."""
        queue = None if plan is None else plan.victims
        self.held_queue = None
        if queue is not None and queue.ndim == 2 and plan.read_table is not None:
            pick = lambda t: np.take_along_axis(t.numpy(), queue, axis=1)  # noqa: E731
            self.held_queue = (plan.past, plan.q_len, pick(plan.read_table), pick(plan.read_pos))

    def _resume_queue(self, plan) -> None:
        """The first plan after a rollback: when it retries the rolled-back step (its position and length, each
        queued page still live in its row at its position), it carries that step's queue, so the steps after it
        evict what they would have without the failure (and it observes nothing, as the step it retries would not
        have)."""
        held, self.held_queue = self.held_queue, None
        if (plan.past, plan.q_len) != held[:2] or plan.read_table is None or len(plan.read_table) != len(held[2]):
            return
        columns = np.empty_like(held[2])
        for b, row in enumerate(zip(plan.read_table.tolist(), plan.read_pos.tolist())):
            where = {entry: column for column, entry in enumerate(zip(*row))}  # (page, position): a hole's page is -1
            wanted = list(zip(held[2][b].tolist(), held[3][b].tolist()))
            if not all(entry in where for entry in wanted):
                return
            columns[b] = [where[entry] for entry in wanted]
        plan.victims = columns

    def fork(self, bounded: bool) -> "GroupEviction":
        """The eviction state of a forked group: same history (by page id), clock and exactness, its own count."""
        twin = GroupEviction(self.policy, bounded, self.history, self.clock)
        twin.exact_tokens = self.exact_tokens
        return twin

    def planned(self, plan, written: bool = False) -> None:
        """A step was planned: advance the clock; pages it writes are recent, pages it starts are fresh (in the
        history; ``written``: `PlanStack` wrote every group's at once, `StackedHistories`)."""
        self.clock += 1
        self.evicted = []
        if self.held_queue is not None:
            self._resume_queue(plan)
        if plan.read_table is None or written:
            return
        slots = _ids(plan.slots)
        S = plan.page_size
        self.history.written(slots // S if S > 1 else slots, self.clock, slots % S == 0 if S > 1 else True)

    def probe(self, plan) -> "UsageProbe | None":
        """What attention measures of a layer in ``plan``'s step for this policy, or None when it tracks no usage or
        needs none: a policy that ranks by the last share whose next victims are known (``plan.victims``, queued by
        an ``interval``; the shares of the step before the next choice pick them)."""
        if not self.tracks_usage or (plan.victims is not None and self.policy.ranks_by_last_share):
            return None
        return UsageProbe(plan, self.policy)

    def record(self, plan) -> None:
        """Hand the step's attention per page to the policy (once); a policy that ranks pages by their last share
        keeps the shares on the plan, by live column (`recycle` ranks the columns by them)."""
        if plan is None or plan.usage is None:
            return
        shares = self.policy.record(self.history, plan.read_table, plan.usage, self.clock)
        plan.usage, plan.shares = None, shares if self.policy.ranks_by_last_share else None

    def reserve(self, manager, rows: list[list[int]], first_page: int, num_tokens: int, needed: int,
                fresh: bool, last) -> None:
        """Make ``needed`` pages available for a step after ``num_tokens`` tokens, or raise `PagePoolExhausted`
        (``last``: the group's last plan, see `evict`). With ``compress_prompt``, a fresh prompt over the bound
        goes in whole (cut at commit, see `committed`)."""
        if self.policy.compress_prompt and fresh and manager.max_pages is not None and needed > manager.available():
            manager.overdraw(True)
        else:
            self._demote(manager, rows, first_page, num_tokens, needed)
            if self.policy.lossy and needed > manager.available():
                self.evict(manager, rows, first_page, num_tokens, needed, last)
        manager.require(needed, self.policy.lossy)

    def committed(self, manager, rows: list[list[int]], first_page: int, num_tokens: int, last) -> None:
        """After a prompt prefilled whole (``compress_prompt``): evict down to the bound, by the
        attention of the prompt's last queries; the pool keeps the prompt's size (its peak)."""
        if manager.overdrawn:
            manager.overdraw(False)
            self._demote(manager, rows, first_page, num_tokens, 0)
            self.evict(manager, rows, first_page, num_tokens, 0, last)

    def _demote(self, manager, rows: list[list[int]], first_page: int, num_tokens: int, needed: int) -> None:
        """A pool with a cold format (`hf_paged.demotion`) re-quantizes its coldest pages, by this policy's ranking,
        before anything is evicted; later tokens then differ from a full forward's."""
        cold = manager.cold
        if cold is not None and cold.make_room(manager, rows, first_page, num_tokens, needed, self.policy.sink_pages,
                                               self.give_up_order):
            self.exact_tokens = min(self.exact_tokens, num_tokens)

    def give_up_order(self, pages: np.ndarray, ages: np.ndarray) -> np.ndarray:
        """Ranks of ``pages`` (lowest: given up first): the policy's score or last use, else their ``ages``."""
        return self.policy._rank(self.history, pages) if self.policy.tracks_usage else ages.astype(np.float64)

    def _evicting(self, max_pages: int, num_tokens: int) -> None:
        """Pages are about to be evicted after ``num_tokens`` tokens (logged once per bound)."""
        if self._warned_for != max_pages:
            warn_first_eviction(self.policy, max_pages)
            self._warned_for = max_pages
        self.exact_tokens = min(self.exact_tokens, num_tokens)  # later tokens see fewer: not reusable

    def recycle(self, manager, rows: list[list[int]], num_tokens: int, q_len: int, last):
        """The steady step of a full pool: each row starts one new page (``q_len`` tokens from a page boundary) and
        must evict one for it. When the rows are as the group's last plan ``last`` planned them, each row's victim
        is picked in ``last``'s live table and evicted, but its page stays with the row to hold the new tokens:
        nothing is released or allocated. Its victims are ``last.victims`` when they were picked with other groups'
        (`record_together`). -> (live columns, row entries, pages), one entry per row; None, changing nothing,
        when the step is not such a step or a victim is shared (the general path then evicts)."""
        if not self.recycles(manager, rows, num_tokens, q_len, last):
            return None
        S = manager.page_size
        table, positions = last.read_table.numpy(), last.read_pos.numpy()
        columns = last.victims if last.victims is None or last.victims.ndim == 1 else last.victims[:, 0]
        if columns is None:
            columns = self.policy.victim_columns(table, positions, self.history, S, num_tokens, last.shares)
        if columns is None:
            return None
        columns = columns.tolist()  # (a few rows: scalar reads beat fancy indexing)
        pages = [table.item(b, column) for b, column in enumerate(columns)]
        if any(manager.ref[page] != 1 for page in pages):
            return None
        self._evicting(manager.max_pages, num_tokens)
        entries = [positions.item(b, column) // S - last.first_pos // S for b, column in enumerate(columns)]
        for row, entry, page in zip(rows, entries, pages):
            row[entry] = EVICTED
            manager.forget(page)  # (its content is about to change)
        self.evictions += len(rows)
        return columns, entries, pages

    def recycles(self, manager, rows: list[list[int]], num_tokens: int, q_len: int, last) -> bool:
        """The step after ``num_tokens`` tokens is a full pool's steady step that `recycle` plans from ``last``: each
        row starts one new page and must evict one for it (`pool_recycles`), and the rows are as ``last`` planned
        them."""
        return self.pool_recycles(manager, num_tokens, q_len) and not (
            last is None or last.read_table is None or last.same_as is not None or last.num_tokens != num_tokens
            or last.rows != rows)

    def pool_recycles(self, manager, num_tokens: int, q_len: int) -> bool:
        """The pool's side of `recycles`: a lossy policy's bounded pool, full and of one tier (a cold tier demotes
        first: the general path), and a step of at most a page that starts a page."""
        S = manager.page_size
        return not (not self.policy.lossy or manager.max_pages is None or manager.available() > 0 or num_tokens % S
                    or manager.cold is not None or q_len > S)

    def recycled_step(self, manager, rows: list[list[int]], num_tokens: int, q_len: int, last):
        """The plan of a full pool's steady step (`recycle`; None when it is not one): its victims hold the tokens."""
        picks = self.recycle(manager, rows, num_tokens, q_len, last)
        return None if picks is None else recycle_plan(last, rows, *picks, q_len)

    def extended_step(self, rows: list[list[int]], first_page: int, past: int, num_tokens: int,
                      last):
        """The plan of a step whose rows only lost the pages this step evicted and gained fresh ones (`extend_plan`)."""
        return extend_plan(last, rows, first_page, past, num_tokens, self.evicted)

    def evict(self, manager, rows: list[list[int]], first_page: int, num_tokens: int, needed: int, last) -> None:
        """Drop live pages per the policy, round-robin over rows, until ``needed`` pages are free. The rows are
        ranked through ``last``'s page table (a numpy view) when the group's last plan ``last`` planned them as
        they are, else converted from their lists."""
        self._evicting(manager.bound, num_tokens)
        tables = last.table.numpy() if last is not None and last.rows == rows else rows  # rows as arrays: no copy
        while manager.available() < needed:
            evicted = False
            rounds = -(-(needed - manager.available()) // max(len(rows), 1))
            picks = [self.policy.victims(row, first_page, self.history, rounds) for row in tables]
            tables = rows  # (a next round sees the rows as this one left them)
            for k in range(rounds):  # round-robin: one page per row at a time, in each row's order
                for b, (row, picked) in enumerate(zip(rows, picks)):
                    if k < len(picked):
                        manager.release(row[picked[k]])
                        row[picked[k]] = EVICTED
                        self.evictions += 1
                        self.evicted.append((b, picked[k]))
                        evicted = True
                        if manager.available() >= needed:
                            return
            if not evicted:
                return  # everything left is protected: `require` raises with the numbers


class PlanColumns:
    """Host buffers ``[B, capacity]`` behind a plan's ``table``, ``read_table`` and ``read_pos``, which
    `extend_plan` edits in place: evicted pages become holes, new pages' columns are appended (capacity
    doubles, like a vector). Plans extended from one another share them: each views its own first columns;
    only the newest plan is extended (an older one is finished). ``holes``: the live table's -1 entries."""

    def __init__(self, plan):
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

    def extends(self, plan) -> bool:
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


def extend_plan(last, rows: list[list[int]], first_page: int, past: int, num_tokens: int,
                evicted: list[tuple[int, int]]):
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


def recycle_plan(last, rows: list[list[int]], columns: list[int], entries: list[int], pages: list[int],
                 q_len: int):
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
    return dataclasses.replace(last, q_len=q_len, past=past, num_tokens=past + q_len, table=table,
                               slots=torch.from_numpy(slots), copy_src=None, copy_dst=None, slab=None, same_as=None,
                               read_table=read_table, read_pos=read_pos, usage=None, shares=None, victims=None,
                               _on_device={}, _columns=plan_columns)


class StackedHistories:
    """The `PageHistory` arrays of a `PlanStack`'s groups as the rows of ``[L, P]`` arrays: each history's arrays
    become views of its row (the same numbers, padded with no history), so that one pass writes or folds every
    group's pages (through flat indices: row l's page p is ``l * P + p``). Valid while no history replaced its
    arrays (`PageHistory.cover` grows them; a fork's groups share the histories): `valid` tells, and a stack then
    stacks them anew. ``live``: the stack's live tables ``[L, B, Nk]`` (their pages stay while stacked), whose flat
    indices `fold_last_shares` keeps."""

    def __init__(self, histories: list[PageHistory], live: np.ndarray):
        self.histories = histories
        self.width = max(len(h.ema) for h in histories)
        self.flat = {}
        for name in ("last_used", "ema", "observed"):
            rows = np.zeros((len(histories), self.width), dtype=getattr(histories[0], name).dtype)
            for l, history in enumerate(histories):
                old = getattr(history, name)
                rows[l, :len(old)] = old
                setattr(history, name, rows[l])
            self.flat[name] = rows.reshape(-1)
        PageHistory.replaced += 1
        self._views = [h.ema for h in histories]
        self.offsets = np.arange(len(histories))[:, None] * self.width
        self.live = self._index(live)
        self.counted = np.zeros(len(self.flat["observed"]), dtype=bool)  # (the live pages: one pass counts them;
        self.counted[self.live[self.live < len(self.counted)]] = True  # used while `valid`: each in its row)

    def valid(self, histories: list[PageHistory], highest_page: int) -> bool:
        """These are the stacked histories (in order), still viewing their rows, with a column for every page up to
        ``highest_page``."""
        return (histories == self.histories and highest_page < self.width  # (a list compares its items by identity)
                and all(map(operator.is_, map(operator.attrgetter("ema"), histories), self._views)))

    def _index(self, pages: np.ndarray) -> np.ndarray:
        """Flat indices of group l's ``pages [L, ...]``, in their order."""
        return (pages.reshape(len(self.offsets), -1) + self.offsets).reshape(-1)

    def written(self, pages: np.ndarray, clocks: np.ndarray) -> None:
        """Group l's ``pages [L, B]`` start afresh, written at step ``clocks[l]`` (`PageHistory.written`)."""
        index = self._index(pages)
        self.flat["last_used"][index] = np.repeat(2 * clocks, pages.shape[1])
        self.flat["ema"][index], self.flat["observed"][index] = 0.0, 0

    def fold_last_shares(self, shares: np.ndarray) -> None:
        """Group l's live pages (the stack's, each group's B rows in turn) get their ``shares [L * B, Nk]`` as scores
        (`EvictionPolicy.fold_last_shares`: a page in several rows of a group gets the last row's)."""
        self.flat["ema"][self.live] = shares.reshape(-1)
        np.add(self.flat["observed"], self.counted, out=self.flat["observed"])


class PlanStack:
    """One plan per step for the per-layer page groups of a bounded cache, in a full pool's steady step (each row of
    each group recycles its victim page, `GroupEviction.recycle`): the live tables of the L groups' plans as one
    ``[L, B, Nk]`` array with their positions, and their logical tables as ``[L, B, capacity]``, so that one
    vectorised pass finds every group's victims' pages, edits the tables and makes the slots; group l's `StepPlan`
    views slice l. Each group's victims are its own (its last shares, or its history): the rows, pages, histories
    and plans equal those of L separate `recycle` steps. Invariants: ``plans[l]`` is group l's plan made (or copied)
    last; a step whose groups' plans are others is planned by a new stack, or group by group. The live tables have
    no holes (a recycled page keeps its column)."""

    def __init__(self, plans: list, groups: list):
        (L, (B, n)), live = (len(plans), plans[0].table.shape), plans[0].read_table.shape[1]
        policy = groups[0].policy
        self.policy = policy if policy.name == "score" and all(  # the groups' one "score" policy that `record` records
            g.eviction.tracks_usage and (g.policy is policy or g.policy == policy) for g in groups) else None
        self.width = n
        self.table = np.empty((L, B, max(2 * n, 64)), dtype=np.int64)
        for l, plan in enumerate(plans):
            self.table[l, :, :n] = plan.table.numpy()
        self.read_table = np.stack([plan.read_table.numpy() for plan in plans]).reshape(L, B, live)
        self.read_pos = np.stack([plan.read_pos.numpy() for plan in plans]).reshape(L, B, live)
        self.live = [(torch.from_numpy(t), torch.from_numpy(p)) for t, p in zip(self.read_table, self.read_pos)]
        self.plans = list(plans)
        self.highest = int(self.read_table.max()) if self.read_table.size else -1  # (the live ids stay while stacked)
        self.histories: StackedHistories | None = None  # the groups' histories, stacked by `stacked_histories`
        self.checked = -1  # `PageHistory.replaced` when they were last found valid
        self.rows: list = []  # each group's rows (its list) as the stack's last step planned them
        self.q_pos: torch.Tensor | None = None  # the step's query positions [B, Q], edited in place (`queries`)
        self.memos: list[tuple | None] = [None] * L  # group l's kernel index on the host, its tensors (`_memo`)
        self.slots: tuple | None = None  # the step's slots [L, B * Q]: an array and its rows as tensors (`_slots`)
        self.usage = torch.empty((L, B, live), dtype=torch.float32)  # the step's usage, row l group l's plan's
        self.usage_rows = self.usage.unbind()  # (`StepPlan.usage_out`: a kernel writes it, `record_together` reads it)

    def queries(self, past: int, q_len: int) -> torch.Tensor:
        """The step's query positions ``[B, q_len]`` after ``past`` tokens: one tensor over the stack's steps, edited in
        place, so that every group's kernel index stays the same tensors (a kernel keeps a checked index's arguments,
        `cpu_paged_attention._index_args`; an earlier step's plans are finished)."""
        rows = self.read_table.shape[1]
        if self.q_pos is None or self.q_pos.shape != (rows, q_len):
            self.q_pos, self.memos = query_positions(rows, past, q_len), [None] * len(self.plans)
        else:
            self.q_pos.numpy()[:] = np.arange(past, past + q_len)
        return self.q_pos

    def _slots(self, slots: np.ndarray) -> tuple:
        """Each group's slots of the step, the rows of ``slots [L, B * Q]``: one tensor over the stack's steps, written
        in place as `queries` is (an earlier step's plans are finished), its rows made once."""
        if self.slots is None or self.slots[0].shape != slots.shape:
            self.slots = (slots, torch.from_numpy(slots).unbind())
        else:
            self.slots[0][:] = slots
        return self.slots[1]

    def _memo(self, l: int, num_pages: int, read_table: torch.Tensor, read_pos: torch.Tensor) -> dict:
        """A new plan's memo (its ``_on_device``) holding the kernel index on the host of group l's live table and
        positions with the stack's query positions: made once (`remember_kernel_index`) while they are the same
        tensors, for pools of the same pages (their page ids stay while the stack recycles them)."""
        kept = self.memos[l]
        if kept is None or kept[0] is not read_table or kept[1] is not read_pos or kept[2] != num_pages:
            kept = self.memos[l] = (read_table, read_pos, num_pages, {})
            remember_kernel_index(kept[3], HOST, num_pages, (read_table, read_pos, self.q_pos))
        return dict(kept[3])

    def stacked_histories(self, groups: list) -> StackedHistories | None:
        """The groups' histories stacked (`StackedHistories`), with a column for every live page of the stack; None
        when they cannot be. (``groups``: the stack's, whose histories stay theirs: stacked histories found valid stay
        so while no history's arrays are replaced, `PageHistory.replaced`.)"""
        if self.histories is not None and self.checked == PageHistory.replaced:
            return self.histories
        histories = [group.eviction.history for group in groups]
        if self.histories is None or not self.histories.valid(histories, self.highest):
            if len(set(map(id, histories))) < len(histories):
                return None  # (two groups share a history: their pages' rows would collide)
            self.histories = StackedHistories(histories, self.read_table)
            if not self.histories.valid(histories, self.highest):
                return None
        self.checked = PageHistory.replaced
        return self.histories

    def steady(self, groups: list, batch_size: int, q_len: int) -> bool:
        """The next step of ``groups`` is one that `recycle` plans: their plans are the ones this stack made last, so
        every condition of `plan_stacked` that those plans kept since then holds (read through live tables, no rows
        assumed identical) and is checked once for the stack; per group, the pool's side of `GroupEviction.recycles`
        (`pool_recycles`: a stack made for steps that `advance` planned did not check it), no step open, full
        attention (every page kept), not overdrawn, its rows and length as the stack planned them (the same lists,
        where `recycles` compares them: a group's rows are edited in place only in the steps it plans, which replace
        its plan, or in a rollback, which ends the stack)."""
        n = self.plans[0].num_tokens
        return self.holds([group.step for group in groups]) and all(
            not group.step_open and group.rows is rows and len(rows) == batch_size and group.num_tokens == n
            and group.sliding_window is None and not group.manager.overdrawn
            and group.eviction.pool_recycles(group.manager, n, q_len) for group, rows in zip(groups, self.rows))

    @staticmethod
    def fits(plans: list) -> bool:
        """The plans have one shape and step, and live tables without holes: one stack can hold them."""
        key = lambda p: (p.table.shape, p.read_table.shape, p.num_tokens, p.first_pos, p.page_size)  # noqa: E731
        return (all(key(plan) == key(plans[0]) for plan in plans)
                and not any(bool((plan.read_table == EVICTED).any()) for plan in plans))

    def holds(self, plans: list) -> bool:
        """``plans`` are the plans this stack made last, in its order."""
        return len(plans) == len(self.plans) and all(a is b for a, b in zip(plans, self.plans))

    def record(self, groups: list) -> bool:
        """`record_together` for the step this stack planned: ``groups``' steps are its plans, each with its usage
        (summed over the group's layers: the group's step is open), of the groups' one "score" policy; the shares of
        the stacked live tables in one pass, folded into the stacked histories when there is no decay. False,
        changing nothing, when the steps are not so."""
        plans, policy = [group.step for group in groups], self.policy
        if policy is None or not self.holds(plans):
            return False
        if policy.interval > 1 and all(plan.usage is None and plan.victims is not None for plan in plans):
            return True  # (nothing observed: every group's next victims are queued, `GroupEviction.probe`)
        if any(plan.usage is None for plan in plans):
            return False
        written = all(map(operator.is_, map(operator.attrgetter("usage"), plans), self.usage_rows))
        device = plans[0].usage.device
        if not written and any(plan.usage.device != device for plan in plans):
            return False  # (each group records its own step when it commits)
        tables = self.read_table.reshape(-1, self.read_table.shape[2])
        usage = self.usage.view(tables.shape) if written else torch.cat([plan.usage for plan in plans])
        shares = policy.whole_shares(tables, usage, whole=True)  # (a stack has no holes)
        if shares is None:
            return False
        histories = self.stacked_histories(groups) if not policy.decay else None
        fold_and_pick(policy, groups, plans, tables, shares, histories, lambda: self.read_pos.reshape(tables.shape))
        return True

    def _victims(self, groups: list) -> tuple[np.ndarray, list] | None:
        """``[L, B]``: the live column each row of each group gives up (`recycle`'s choice), and each group's queue of
        the columns its next steps give up (``[B, k]``, or None; `EvictionPolicy.victim_queue`); None when a row of
        some group has every page protected."""
        columns, queues = np.empty(self.read_table.shape[:2], dtype=np.int64), [None] * len(groups)
        for l, (group, plan) in enumerate(zip(groups, self.plans)):
            picked = plan.victims
            if picked is None:
                picked = group.policy.victim_queue(self.read_table[l], self.read_pos[l], group.eviction.history,
                                                   plan.page_size, plan.num_tokens, plan.shares)
            if picked is None:
                return None
            if picked.ndim == 2:
                picked, queues[l] = picked[:, 0], picked[:, 1:] if picked.shape[1] > 1 else None
            columns[l] = picked
        return columns, queues

    def recycle(self, groups: list, q_len: int) -> bool:
        """Plan the step of every group (`LayerGroup.begin_planned`): each row's victim page takes its ``q_len`` new
        tokens. False, changing nothing, when some group cannot (a protected row, a shared victim)."""
        picks = self._victims(groups)
        if picks is None:
            return False
        columns, queues = picks
        L, B = columns.shape
        at = (np.arange(L)[:, None], np.arange(B), columns)
        pages = self.read_table[at]
        page_rows = pages.tolist()
        if any(group.manager.ref[page] != 1 for group, row in zip(groups, page_rows) for page in row):
            return False
        S, past, first_pos = self.plans[0].page_size, self.plans[0].num_tokens, self.plans[0].first_pos
        entries = self.read_pos[at] // S - first_pos // S
        self.read_pos[at] = past
        n = self.width
        if n == self.table.shape[2]:  # (capacity doubles, like a vector)
            self.table = np.concatenate([self.table, np.empty_like(self.table)], axis=2)
        self.table[np.arange(L)[:, None], np.arange(B), entries] = EVICTED
        self.table[:, :, n] = pages
        self.width = n + 1
        slots = pages * S if q_len == 1 else (pages[..., None] * S + np.arange(q_len)).reshape(L, -1)
        self.queries(past, q_len)
        histories = self.stacked_histories(groups)
        if histories is not None:  # (each victim page starts afresh, written at its group's next clock)
            histories.written(pages, np.array([group.eviction.clock + 1 for group in groups]))
        self.rows = [group.rows for group in groups]
        tables, slot_rows = torch.from_numpy(self.table)[:, :, :self.width].unbind(), self._slots(slots)
        for l, (group, entry_row) in enumerate(zip(groups, entries.tolist())):
            self.plans[l] = group.begin_planned(self._recycled, l, group, entry_row, page_rows[l], tables[l],
                                                slot_rows[l], q_len, queues[l], stacked=histories is not None)
        return True

    def advance(self, groups: list, q_len: int) -> bool:
        """Plan the step of every group whose rows' ``q_len`` new tokens fit in their last pages (`continue_plan`):
        only the slots move. -> True."""
        S, past = self.plans[0].page_size, self.plans[0].num_tokens
        last_pages = self.table[:, :, self.width - 1]
        slots = (last_pages[..., None] * S + past % S + np.arange(q_len)).reshape(len(groups), -1)
        self.queries(past, q_len)
        self.rows = [group.rows for group in groups]
        for l, (group, slot_row) in enumerate(zip(groups, self._slots(slots))):
            self.plans[l] = group.begin_planned(self._continued, l, group, slot_row, q_len)
        return True

    def _continued(self, l: int, group, slots: torch.Tensor, q_len: int):
        last = self.plans[l]
        return last.but(q_len=q_len, past=last.num_tokens, num_tokens=last.num_tokens + q_len, slots=slots,
                        copy_src=None, copy_dst=None, usage=None, shares=None, victims=None,
                        usage_out=self.usage_rows[l],
                        _on_device=self._memo(l, group.manager.num_pages, last.read_table, last.read_pos))

    def _recycled(self, l: int, group, entries: list[int], pages: list[int], table: torch.Tensor, slots: torch.Tensor,
                  q_len: int, queue: np.ndarray | None):
        """Group l's part of `recycle`: its rows' entries ``entries`` (pages ``pages``) are evicted and the pages
        appended to hold the new tokens (as `GroupEviction.recycle`, then `recycle_plan`); -> its plan (logical
        ``table``, ``slots``, the ``queue`` of its next victims), with its kernel index on the host (`_memo`)."""
        eviction, manager, last = group.eviction, group.manager, self.plans[l]
        eviction._evicting(manager.max_pages, last.num_tokens)
        for row, planned, entry, page in zip(group.rows, last.rows, entries, pages):
            row[entry] = planned[entry] = EVICTED
            manager.forget(page)  # (its content is about to change)
            row.append(page)
            planned.append(page)
        eviction.evictions += len(pages)
        read_table, read_pos = self.live[l]
        return last.but(q_len=q_len, past=last.num_tokens, num_tokens=last.num_tokens + q_len, table=table, slots=slots,
                        copy_src=None, copy_dst=None, slab=None, same_as=None, read_table=read_table, read_pos=read_pos,
                        usage=None, shares=None, victims=queue, _columns=None, usage_out=self.usage_rows[l],
                        _on_device=self._memo(l, manager.num_pages, read_table, read_pos))


def plan_stacked(groups: list, stack: PlanStack | None, q_len: int, continuing: bool,
                 steady: bool = False) -> PlanStack | None:
    """Plan the step of every group in ``groups`` (per-layer groups of one cache, each able to begin a step that
    keeps its rows' tables, its last step final) at once when they are all in one steady state: each row's new
    tokens fit in its last page (``continuing``: `step_plan.continues` holds for every group), or each row of a
    full pool recycles a victim (`GroupEviction.recycles`); through ``stack`` when it made their plans, else a new
    one (``steady``: ``stack.steady`` holds, it recycles). -> the stack that planned the step; None, changing nothing,
    when the groups are not so (each then plans its own)."""
    if steady:
        return stack if stack.recycle(groups, q_len) else None
    plans = [group.step for group in groups]
    if continuing and all(plan.read_table is not None for plan in plans):
        step = PlanStack.advance
    elif all(group.eviction.recycles(group.manager, group.rows, group.num_tokens, q_len, plan)
             for group, plan in zip(groups, plans)):
        step = PlanStack.recycle
    else:
        return None
    if stack is None or not stack.holds(plans):
        if not PlanStack.fits(plans):
            return None
        stack = PlanStack(plans, groups)
    return stack if step(stack, groups, q_len) else None


def record_together(groups, stack: PlanStack | None = None) -> bool:
    """Record the step of every group of a "score" policy in one pass over all their live tables (a row's shares
    depend on its row only; each group folds them into its own history, `EvictionPolicy.fold_whole`), and, when the
    policy ranks pages by their last share (no decay, `EvictionPolicy.ranks_by_last_share`), pick their next victims:
    the live columns `GroupEviction.recycle` evicts if the next step recycles. (``groups``: the page groups of one
    cache; ``stack``: the `PlanStack` that planned the step, `PlanStack.record`.) -> True when ``stack`` planned and
    this recorded the step of every group: each group's open step then only ends (it appended the pages it recycled:
    nothing to release, and no group is overdrawn)."""
    if stack is not None and stack.record(groups):
        return all(plan.usage is None for plan in stack.plans)  # (a decayed average may leave a group its own)
    picking = [g for g in groups if g.eviction is not None and g.eviction.tracks_usage and g.policy.name == "score"
               and g.step is not None and g.step.usage is not None]
    plans = [g.step for g in picking]
    if len(plans) < 2:
        return False
    policy, first = picking[0].policy, plans[0]
    key = lambda p: (p.usage.device, p.read_table.shape, p.num_tokens, p.page_size)  # noqa: E731
    if not all(g.policy is policy or g.policy == policy for g in picking) or not all(key(p) == key(first)
                                                                                       for p in plans):
        return False  # (each group records its own step when it commits)
    tables = np.concatenate([p.read_table.numpy() for p in plans])
    shares = policy.whole_shares(tables, torch.cat([p.usage for p in plans]))
    if shares is not None:
        fold_and_pick(policy, picking, plans, tables, shares, None, lambda: np.concatenate(
            [p.read_pos.numpy() for p in plans]))
    return False


def fold_and_pick(policy: EvictionPolicy, groups: list, plans: list, tables: np.ndarray, shares: np.ndarray,
                  histories: StackedHistories | None, positions) -> None:
    """`record_together`'s end: group l's rows of ``shares`` (of its live pages, rows of ``tables``) fold into its
    history (or every group's at once into ``histories``, their scores when there is no decay), its plan keeps them
    (`EvictionPolicy.ranks_by_last_share`) and its next victims, picked in one pass over ``positions()``."""
    rows = len(tables) // len(plans)  # (each plan's rows, as views: np.split costs more)
    if histories is not None:  # (no decay: the shares become the scores, every group's in one pass)
        histories.fold_last_shares(shares)
    for l, (group, plan) in enumerate(zip(groups, plans)):
        part = shares[l * rows:(l + 1) * rows]
        if histories is not None or policy.fold_whole(group.eviction.history, tables[l * rows:(l + 1) * rows], part):
            plan.usage, plan.shares = None, part if policy.ranks_by_last_share else None
    if not policy.ranks_by_last_share:
        return
    columns = policy.victim_queue(None, positions(), None, plans[0].page_size, plans[0].num_tokens, shares)
    for l, plan in enumerate(plans if columns is not None else ()):
        plan.victims = columns[l * rows:(l + 1) * rows]
