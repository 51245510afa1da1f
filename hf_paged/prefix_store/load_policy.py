"""Load a stored prefix or recompute it: whichever is estimated faster.

A backend's read bandwidth is measured from its own reads (bytes / seconds of each `get`, verification
included), decayed so that it follows a changing disk or network. Loading ``n`` bytes is estimated at
``n / bandwidth``; recomputing ``t`` tokens at ``t / prefill_tokens_per_s`` (measured by the caller).
Without a measured bandwidth the decision is to load (that read measures it). A store that recomputed
``probe_every`` times in a row loads once more, so an estimate made on a slow moment cannot lock loading
out for good.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


class ReadBandwidth:
    """Bytes per second of a backend's reads: decayed sums of bytes and seconds of every read.

    Invariant: `bytes_per_second` is None until a read of at least one byte taking a positive time
    was recorded; after that it is ``decayed bytes / decayed seconds`` (each read weighs by its length).
    """

    def __init__(self, decay: float = 0.75):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self._bytes = 0.0
        self._seconds = 0.0
        self._lock = threading.Lock()

    def record(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._bytes = self._bytes * self.decay + nbytes
            self._seconds = self._seconds * self.decay + seconds

    @property
    def bytes_per_second(self) -> float | None:
        with self._lock:
            return self._bytes / self._seconds if self._seconds > 0 else None


@dataclass(frozen=True)
class LoadDecision:
    """Whether to load ``nbytes`` rather than recompute ``tokens``, with the estimates behind it."""
    load: bool
    nbytes: int
    tokens: int
    load_seconds: float | None       # estimated; None without a measured bandwidth
    recompute_seconds: float | None  # estimated; None without a prefill rate
    reason: str


def decide(bytes_per_second: float | None, nbytes: int, tokens: int, prefill_tokens_per_s: float | None,
           probe: bool = False) -> LoadDecision:
    """Load unless reading ``nbytes`` at ``bytes_per_second`` is estimated slower than prefilling ``tokens``.

    ``probe=True`` loads regardless (to measure the bandwidth again).
    """
    if nbytes < 0 or tokens < 0:
        raise ValueError(f"nbytes and tokens must be >= 0, got {nbytes} and {tokens}")
    if prefill_tokens_per_s is not None and prefill_tokens_per_s <= 0:
        raise ValueError(f"prefill_tokens_per_s must be positive, got {prefill_tokens_per_s}")
    load_s = nbytes / bytes_per_second if bytes_per_second else None
    compute_s = tokens / prefill_tokens_per_s if prefill_tokens_per_s else None
    if load_s is None:
        return LoadDecision(True, nbytes, tokens, None, compute_s, "no read bandwidth measured yet: load (and measure)")
    if compute_s is None:
        return LoadDecision(True, nbytes, tokens, load_s, None, "no prefill rate given: load")
    if load_s < compute_s:
        return LoadDecision(True, nbytes, tokens, load_s, compute_s, "loading is estimated faster")
    if probe:
        return LoadDecision(True, nbytes, tokens, load_s, compute_s, "recomputing is estimated faster, but the "
                            "bandwidth estimate is re-measured by loading once")
    return LoadDecision(False, nbytes, tokens, load_s, compute_s, "recomputing is estimated faster")


class LoadPolicy:
    """`decide` with one store's measured bandwidth; counts its recomputes and re-measures after a streak."""

    def __init__(self, probe_every: int = 32):
        self.bandwidth = ReadBandwidth()
        self.probe_every = probe_every
        self._streak = 0
        self._lock = threading.Lock()

    def decide(self, nbytes: int, tokens: int, prefill_tokens_per_s: float | None) -> LoadDecision:
        with self._lock:
            decision = decide(self.bandwidth.bytes_per_second, nbytes, tokens, prefill_tokens_per_s,
                              probe=self._streak >= self.probe_every)
            self._streak = 0 if decision.load else self._streak + 1
        return decision
