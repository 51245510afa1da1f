"""transformers' `QuantizedCache` (optimum-quanto backend), the peer quantized pages are measured against (issue 32).

Its layers keep a quantized history and a float residual of at most ``residual_length`` tokens: the first update
(the prefill) quantizes every token it is given but attends to them in full precision; each later update dequantizes
the whole history, appends the residual and the new tokens, and once the residual reaches ``residual_length``
re-quantizes all of it. With the quanto backend and its defaults (``axis=0``, groups of 64) a group is one token's
row of one head (head dim 64): 4 or 2 bits a value, a float32 scale and shift per group.

Scoring a text through it in chunks of exactly ``residual_length`` tokens (`log_probs`) gives every token the view
it would have in decoding after a prompt of that many tokens: the history before its chunk quantized, its chunk's
earlier tokens and itself in full precision; one forward of the whole text would read nothing quantized.

Everything here needs optimum-quanto (the ``eval`` extra); `unavailable_reason` says why it cannot run, so the
studies skip its rows with that reason instead of failing.
"""

from __future__ import annotations

import copy

import torch

from ..model_config import CACHE_KWARG
from .nll import CacheStream

RESIDUAL = 128  # transformers' default residual_length


def name(nbits: int, residual_length: int = RESIDUAL) -> str:
    residual = "" if residual_length == RESIDUAL else f", residual {residual_length}"
    return f"QuantizedCache int{nbits} (quanto{residual})"


def unavailable_reason() -> str | None:
    """None when transformers' QuantizedCache runs with the quanto backend here, else why not."""
    try:
        import optimum.quanto  # noqa: F401
        from transformers import QuantizedCache  # noqa: F401
        from transformers.cache_utils import QuantoQuantizedLayer

        QuantoQuantizedLayer(nbits=4)
    except Exception as error:  # ImportError, or the version check of transformers' layer
        return f"transformers' QuantizedCache(backend='quanto') is unavailable: {type(error).__name__}: {error} " \
               "(pip install optimum-quanto, the 'eval' extra)"
    return None


def make_cache(config, nbits: int, residual_length: int = RESIDUAL):
    """An empty `QuantizedCache` with the quanto backend, ``nbits`` bits, the other settings transformers' own."""
    from transformers import QuantizedCache

    return QuantizedCache(backend="quanto", config=config, nbits=nbits, residual_length=residual_length)


def _tensor_bytes(tensor) -> int:
    """Bytes a (possibly quanto) tensor stores: a quantized one's packed codes, scales and shifts."""
    if tensor is None:
        return 0
    parts = [getattr(tensor, attr) for attr in ("_data", "_scale", "_shift") if hasattr(tensor, attr)]
    if not parts:
        return tensor.numel() * tensor.element_size()
    return sum(_tensor_bytes(part) for part in parts)


def kv_bytes(cache) -> int:
    """Bytes of every layer's keys and values: the quantized history (codes, scales, shifts) and the float residual."""
    total = 0
    for layer in cache.layers:
        for attr in ("_quantized_keys", "_quantized_values", "keys", "values"):
            total += _tensor_bytes(getattr(layer, attr, None))
    return total


def fork(cache):
    """A cache to decode from that leaves ``cache`` as it is: new layer objects sharing its tensors. QuantizedCache has
    no fork and quanto's tensors cannot be deep-copied, but its layers never change a tensor in place (an update
    assigns new ones, a re-quantization a new quantized history), so sharing them is safe."""
    twin = copy.copy(cache)
    twin.layers = [copy.copy(layer) for layer in cache.layers]
    return twin


@torch.no_grad()
def log_probs(model, ids: torch.Tensor, nbits: int, residual_length: int = RESIDUAL) -> torch.Tensor:
    """float32 log-probabilities ``[T - 1, V]`` of every next token of ``ids`` (1-D), the text fed through a fresh
    `QuantizedCache` in chunks of ``residual_length`` tokens (module docstring: each token's decoding view)."""
    stream = CacheStream(model, make_cache(model.config, nbits, residual_length), CACHE_KWARG)
    return stream.log_probs(ids, residual_length)


def bytes_per_token(model, ids: torch.Tensor, nbits: int, residual_length: int = RESIDUAL) -> dict:
    """KV bytes per token after a prefill of ``ids`` (all quantized, residual empty) and with a full residual
    (``residual_length - 1`` more tokens kept in float, the most it holds between re-quantizations)."""
    cache = make_cache(model.config, nbits, residual_length)
    with torch.no_grad():
        model(input_ids=ids[None], use_cache=True, **{CACHE_KWARG: cache})
        quantized = kv_bytes(cache) / len(ids)
        layer = cache.layers[0]
        per_float_token = 2 * layer._quantized_keys.shape[1] * layer._quantized_keys.shape[-1] \
            * torch.finfo(model.dtype).bits // 8 * len(cache.layers)
    worst = (quantized * len(ids) + (residual_length - 1) * per_float_token) / (len(ids) + residual_length - 1)
    return dict(prefilled=quantized, full_residual=worst, tokens=len(ids), residual_length=residual_length,
                residual_bytes_per_token=per_float_token)


__all__ = ["RESIDUAL", "bytes_per_token", "fork", "kv_bytes", "log_probs", "make_cache", "name",
           "unavailable_reason"]
