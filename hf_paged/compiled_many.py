"""`torch.compile` of `generate_many`'s packed steps (``generate_many(..., compile=True)``).

A packed step's planning is Python (the scheduler, `RaggedCache.begin_step`) and runs before the forward, as in
eager steps. Inside the compiled forward each layer's `RaggedLayer.update` hands attention a `RaggedRead` (its new
keys and values, its layer index), and the attention function calls one custom op, ``hf_paged::ragged_attention``,
which at run time writes the keys and values into the planned slots and attends with the eager paged path (C kernel
for decode rows, SDPA per prefill chunk): the cache is found through `active_cache`, set around the forward by the
caller, so no Python object of the cache enters the graph and a new cache per call is no recompile. Everything
around attention is inductor's: norms, rotary, SiLU * mul and residual adds fused, linear weights frozen and packed
for oneDNN, and linears that read the same input (q/k/v, gate/up) merged into one GEMM (inductor's
``freezing`` and ``cpp.enable_concat_linear``). Token counts are dynamic: a step of any size reuses the graph
(besides one graph for one-token steps, which Dynamo specializes).

Invariants:
- the compiled forward is made once per model (`compile_many_steps`) and kept on it; a forward is only run inside
  `active_cache` (the op refuses otherwise, saying what to do);
- frozen weights are copies taken at the first compiled forward: weights changed afterwards are not seen until
  `compile_many_steps(model, recompile=True)`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from .errors import CacheUsageError

_COMPILED = "_hf_paged_compiled_many"  # attribute of a model that holds its compiled forward
INDUCTOR_OPTIONS = {"freezing": True, "cpp.enable_concat_linear": True}
_active = threading.local()  # .cache: the RaggedCache of this thread's running compiled forward


class RaggedRead:
    """What a `RaggedLayer` hands attention inside a compiled forward: its layer index and the step's new keys and
    values ``[1, kv_heads, T, dim]`` (not yet written: the attention op writes them into their slots)."""

    def __init__(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        self.layer_idx, self.new_keys, self.new_values = layer_idx, keys, values

    def attend(self, query, scaling: float, sliding_window, softcap, s_aux) -> torch.Tensor:
        return ragged_attention(query, self.new_keys, self.new_values, self.layer_idx, scaling, sliding_window, softcap,
                                s_aux)


@contextlib.contextmanager
def active_cache(cache) -> Iterator[None]:
    """Compiled forwards in this block (this thread) write into and read from ``cache`` (a `RaggedCache` whose
    step is planned)."""
    before = getattr(_active, "cache", None)
    _active.cache = cache
    try:
        yield
    finally:
        _active.cache = before


@torch.library.custom_op("hf_paged::ragged_attention", mutates_args=())
def ragged_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, scale: float,
                     sliding_window: int | None, softcap: float | None, s_aux: torch.Tensor | None) -> torch.Tensor:
    """Write the step's ``keys``/``values`` of layer ``layer_idx`` into the active cache's planned slots, then attend
    ``query [1, Hq, T, D]`` over the pages (the eager packed path); returns ``[1, T, Hq, Dv]``."""
    cache = getattr(_active, "cache", None)
    if cache is None:
        raise CacheUsageError("a forward compiled by compile_many_steps runs inside hf_paged.compiled_many."
                              "active_cache(cache), with the RaggedCache whose step is planned: it is driven by "
                              "generate_many(..., compile=True).")
    out = cache.layers[layer_idx].write_and_attend(query, keys, values, scale, sliding_window, softcap, s_aux)
    return out.to(query.dtype).contiguous()


@ragged_attention.register_fake
def _(query, keys, values, layer_idx, scale, sliding_window, softcap, s_aux):
    return query.new_empty(1, query.shape[2], query.shape[1], values.shape[-1])


def compile_many_steps(model: torch.nn.Module, backend: str = "inductor", recompile: bool = False):
    """The compiled forward `generate_many(..., compile=True)` runs for ``model``, made on the first call and kept
    on the model; ``recompile`` makes a new one (after the weights changed). With inductor, its freezing and
    linear-merging options (`INDUCTOR_OPTIONS`) are on while the forward runs (they are read when it compiles, which
    ``torch.compile(options=...)`` does not reach for freezing); another ``backend`` (e.g. ``"eager"``) compiles
    with its defaults."""
    compiled = model.__dict__.get(_COMPILED)
    if compiled is None or recompile or compiled[0] != backend:
        forward = torch.compile(model.forward, backend=backend, dynamic=True)
        compiled = (backend, _with_options(forward) if backend == "inductor" else forward)
        model.__dict__[_COMPILED] = compiled
    return compiled[1]


def _with_options(forward):
    def frozen_forward(*args, **kwargs):
        with torch._inductor.config.patch(INDUCTOR_OPTIONS):
            return forward(*args, **kwargs)

    return frozen_forward
