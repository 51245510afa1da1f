"""What a `generate_many` run reports, while it runs and after it, and the page accounting of a `RaggedCache`.

`GenerationStats` is filled by the run as it goes: per output its admission, first-token and finish times (seconds
from the run's start, when every prompt arrived) and its finish reason; per run the steps, tokens computed and
generated, prefix hits, and after every step the queue and the page pool. Observers (the Prometheus exporter of
`hf_paged.metrics`) registered with `add_observer` are told of every step, first token and finished output, from
the thread of the run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .demotion import tier_stats


def ragged_cache_stats(cache) -> dict:
    """`PagedCache.stats`'s fields for a `RaggedCache`, summed over its layer groups (it never evicts a live page,
    so ``evictions`` is 0, and ``tokens_held`` is ``tokens_stored``), with its prefix listeners' counters and, with a
    cold format, its tiers' (`hf_paged.demotion.tier_stats`)."""
    managers = [group.manager for group in cache.groups]
    tokens = sum(seq.length for seq in cache.sequences.values())
    out = dict(page_size=cache.page_size, pages_total=sum(m.num_pages for m in managers),
               pages_used=sum(m.num_used for m in managers), pages_free=sum(len(m.free) for m in managers),
               pages_cached=sum(len(m.cached) for m in managers), tokens_stored=tokens,
               kv_bytes=sum(g.store.held_bytes() for g in cache.groups),
               pool_bytes=sum(g.store.pool_bytes() for g in cache.groups), evictions=0, prefix_hits=cache.prefix_hits,
               tokens_held=tokens)
    for group in cache.groups:
        for key, value in group.prefix.stats().items():
            out[key] = out.get(key, 0) + value
    return {**out, **tier_stats(cache.groups)}


@dataclass
class OutputStats:
    """One output of a run; times in seconds from the run's start (None until it happens)."""

    index: int
    prompt_tokens: int
    new_tokens: int = 0
    admitted_s: float | None = None  # its prompt started (left the queue)
    first_token_s: float | None = None  # time to first token (every prompt arrives when the run starts)
    finished_s: float | None = None
    finish_reason: str | None = None  # "stop_token", "stop_string" or "length"


@dataclass
class GenerationStats:
    """One run's counters (cumulative) and gauges (after the last step). ``prefix_hits``: prompt pages this run's
    outputs shared from the cache instead of computing them."""

    outputs: list[OutputStats] = field(default_factory=list)
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens the model computed (prefix hits are not computed)
    generated_tokens: int = 0
    prefix_hits: int = 0
    forward_s: float = 0.0  # seconds in the model's forward
    elapsed_s: float = 0.0  # seconds from the run's start to its last step (or its end)
    queue_length: int = 0  # prompts waiting for pages or a step
    running: int = 0  # outputs decoding or reading their prompt
    pages_used: int = 0
    pages_cached: int = 0
    pages_total: int = 0
    started: float = field(default=0.0, repr=False)  # time.perf_counter() at the start

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the run so far."""
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def mean_ttft_s(self) -> float | None:
        times = [o.first_token_s for o in self.outputs if o.first_token_s is not None]
        return sum(times) / len(times) if times else None

    def summary(self) -> dict:
        """The run's figures as plain numbers (outputs summarised: finished, mean and largest time to first
        token, finish reasons counted)."""
        reasons: dict[str, int] = {}
        for o in self.outputs:
            if o.finish_reason is not None:
                reasons[o.finish_reason] = reasons.get(o.finish_reason, 0) + 1
        ttfts = [o.first_token_s for o in self.outputs if o.first_token_s is not None]
        return dict(outputs=len(self.outputs), finished=sum(reasons.values()), finish_reasons=reasons,
                    steps=self.steps, prompt_tokens_computed=self.prompt_tokens_computed,
                    generated_tokens=self.generated_tokens, prefix_hits=self.prefix_hits, elapsed_s=self.elapsed_s,
                    forward_s=self.forward_s, tokens_per_s=self.tokens_per_s, mean_ttft_s=self.mean_ttft_s,
                    max_ttft_s=max(ttfts, default=None), queue_length=self.queue_length, running=self.running,
                    pages_used=self.pages_used, pages_cached=self.pages_cached, pages_total=self.pages_total)

    def postfix(self) -> dict:
        """A short summary for a tqdm bar."""
        ttft = self.mean_ttft_s
        return {"tok/s": f"{self.tokens_per_s:.1f}", "queue": self.queue_length, "running": self.running,
                "pages": f"{self.pages_used}+{self.pages_cached} cached", "prefix hits": self.prefix_hits,
                "ttft": "-" if ttft is None else f"{ttft:.2f}s"}

    # ------------------------------------------------------------ recording (by the run)
    def start(self, prompt_tokens: list[int]) -> None:
        """The run starts with these outputs (prompt lengths, one per output)."""
        self.outputs = [OutputStats(i, n) for i, n in enumerate(prompt_tokens)]
        self.started = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.started

    def admitted(self, indices) -> None:
        at = self.now()
        for i in indices:
            if self.outputs[i].admitted_s is None:
                self.outputs[i].admitted_s = at

    def step(self, *, prompt_tokens: int, generated: int, prefix_hits: int, seconds: float, queue_length: int,
             running: int, cache_stats: dict) -> None:
        """A step was computed (``generated``: outputs that got a token from it)."""
        self.steps += 1
        self.prompt_tokens_computed += prompt_tokens
        self.generated_tokens += generated
        self.prefix_hits += prefix_hits
        self.forward_s += seconds
        self.elapsed_s = self.now()
        self.queue_length, self.running = queue_length, running
        self.pages_used, self.pages_cached = cache_stats["pages_used"], cache_stats["pages_cached"]
        self.pages_total = cache_stats["pages_total"]
        for observer in observers():
            observer.step(self, prompt_tokens=prompt_tokens, generated=generated, prefix_hits=prefix_hits)

    def token(self, index: int) -> None:
        output = self.outputs[index]
        output.new_tokens += 1
        if output.first_token_s is None:
            output.first_token_s = self.now()
            for observer in observers():
                observer.first_token(self, output)

    def finished(self, index: int, reason: str) -> None:
        output = self.outputs[index]
        output.finished_s, output.finish_reason = self.now(), reason
        for observer in observers():
            observer.finished(self, output)

    def end(self) -> None:
        self.elapsed_s = self.now()


_observers: list = []
_lock = threading.Lock()


def add_observer(observer) -> None:
    """``observer`` (methods ``step(stats, *, prompt_tokens, generated, prefix_hits)``, ``first_token(stats,
    output)``, ``finished(stats, output)``) hears of every run in this process from now on."""
    with _lock:
        _observers.append(observer)


def remove_observer(observer) -> None:
    with _lock:
        if observer in _observers:
            _observers.remove(observer)


def observers() -> list:
    with _lock:
        return list(_observers)
