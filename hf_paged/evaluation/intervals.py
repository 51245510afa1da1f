"""Paired bootstrap intervals of a perplexity ratio: does a difference hold across a text, or is it a few blocks'?"""

from __future__ import annotations

import numpy as np


def perplexity_ratio(diff, tokens, axis=-1):
    """ppl / ppl_ref - 1 from per-block NLL differences ``diff`` and token counts ``tokens`` (vectorized)."""
    return np.expm1(diff.sum(axis=axis) / tokens.sum(axis=axis))


def paired_ratio_interval(nll, reference_nll, tokens, confidence: float = 0.95,
                          resamples: int = 9999) -> tuple[float, float, float]:
    """(ratio, low, high): the perplexity of per-block NLL sums ``nll`` relative to ``reference_nll`` (the same
    blocks, ``tokens`` each), ``ratio = ppl / ppl_ref - 1``, with a ``confidence`` interval from resampling the
    blocks in pairs (scipy.stats.bootstrap, BCa, seeded). When no block's NLL per token differs from another's
    (e.g. nothing evicted yet), the interval is the ratio itself."""
    from scipy.stats import bootstrap

    diff = np.subtract(nll, reference_nll)
    tokens = np.asarray(tokens, dtype=np.float64)
    value = float(perplexity_ratio(diff, tokens))
    if not np.ptp(diff / tokens) > 0:
        return value, value, value
    interval = bootstrap((diff, tokens), perplexity_ratio, paired=True, vectorized=True, confidence_level=confidence,
                         n_resamples=resamples, method="BCa", rng=np.random.default_rng(0)).confidence_interval
    return value, float(interval.low), float(interval.high)
