"""`torch.compile` of `generate_many`'s packed steps (``generate_many(..., compile=True)``).

A packed step's planning is Python (the scheduler, `RaggedCache.begin_step`) and runs before the forward, as in
eager steps. Inside the compiled forward each layer's `RaggedLayer.update` hands attention a `RaggedRead` (its new
keys and values, its layer index), and the attention function calls one custom op, ``hf_paged::ragged_attention``,
which at run time writes the keys and values into the planned slots and attends with the eager paged path (C kernel
for decode rows, the C prefill kernel or SDPA for prefill chunks): the cache is found through `active_cache`, set
around the forward by the caller, so no Python object of the cache enters the graph and a new cache per call is no
recompile. Everything around attention is inductor's: norms, rotary, SiLU * mul and residual adds fused, linear
weights frozen and packed for oneDNN, and linears that read the same input (q/k/v, gate/up) merged into one GEMM
(inductor's ``freezing`` and ``cpp.enable_concat_linear``). Token counts are dynamic: a step of any size reuses the
graph (besides one graph for one-token steps, which Dynamo specializes). A step shaped like an earlier one skips
Dynamo's guard evaluation (`SteadyForward`): the steady decode steps cost the graph and the op, not the guards over
the model's modules.

Invariants:
- the compiled forward is made once per model (`compile_many_steps`) and kept on it; a forward is only run inside
  `active_cache` (the op refuses otherwise, saying what to do);
- frozen weights are copies taken at the first compiled forward, and the model's modules and config are not checked
  again on steps shaped like earlier ones: changes afterwards are not seen until
  `compile_many_steps(model, recompile=True)`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from .errors import CacheUsageError
from .huge_pages import packed_weights_to_huge_pages

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
    linear-merging options (`INDUCTOR_OPTIONS`) are on while the forward compiles (they are read when it compiles,
    which ``torch.compile(options=...)`` does not reach for freezing); another ``backend`` (e.g. ``"eager"``)
    compiles with its defaults. Calls like an earlier one skip Dynamo's guards (`SteadyForward`)."""
    compiled = model.__dict__.get(_COMPILED)
    if compiled is None or recompile or compiled[0] != backend:
        forward = torch.compile(model.forward, backend=backend, dynamic=True)
        compiled = (backend, SteadyForward(forward, INDUCTOR_OPTIONS if backend == "inductor" else {}))
        model.__dict__[_COMPILED] = compiled
    return compiled[1]


class SteadyForward:
    """A compiled forward that evaluates Dynamo's guards only on calls unlike every earlier one.

    A call is like an earlier one when its keyword arguments match: tensors by shape, strides, dtype and device, plain
    values by value, other objects (the cache) by type; and torch's global state (grad mode, autocast, ...) is the same.
    Such a call found or compiled its graph the first time, so it runs with ``skip_guard_eval_unsafe`` (only the guards
    that tell the compiled graphs apart: those of the shapes). Invariants: the model is what it was when first compiled
    (weights, modules, config; a change needs ``compile_many_steps(model, recompile=True)``, as frozen weights do); any
    other call (a new shape, another state or a stance other than the default) evaluates every guard, compiling under
    ``options`` (inductor's config) if it must, as does a steady call that no graph fits (Dynamo was reset: Dynamo
    raises before running anything); at most `MAX_KEYS` kinds of call are remembered (then forgotten, all at once).
    A call that compiled new graphs moves the packed weights their freezing made onto 2 MB pages
    (`hf_paged.huge_pages.packed_weights_to_huge_pages`; ``huge_page_bytes``: how many bytes the last one moved).
    """

    MAX_KEYS = 4096

    def __init__(self, forward, options: dict):
        self.forward, self.options = forward, options
        self.seen: dict[tuple, torch._C._dynamo.guards.GlobalStateGuard] = {}  # kind of call -> its global state
        self.huge_page_bytes = 0  # of the packed weights, after the last compile (`hf_paged.huge_pages`)

    def __call__(self, **kwargs):
        key = tuple((name, *_call_kind(value)) for name, value in sorted(kwargs.items()))
        state = self.seen.get(key)
        if state is not None and state.check() and torch._dynamo.eval_frame._stance.stance == "default":
            try:
                with _skip_guards():
                    return self.forward(**kwargs)
            except RuntimeError as error:  # no graph fits (Dynamo's caches were reset): before anything ran
                if "skip_guard_eval_unsafe" not in str(error):
                    raise
                self.seen.clear()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with torch._inductor.config.patch(self.options):
            out = self.forward(**kwargs)
        if torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs:  # new graphs, new frozen weights
            self.huge_page_bytes = packed_weights_to_huge_pages()
        if len(self.seen) >= self.MAX_KEYS:
            self.seen.clear()
        self.seen[key] = torch._C._dynamo.guards.GlobalStateGuard()
        return out


def _call_kind(value) -> tuple:
    """What Dynamo's guards may read of a forward's argument: a tensor's shape, strides, dtype and device; a plain
    value; the type of anything else."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.stride(), value.dtype, value.device
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value), value
    return (type(value),)


def _skip_guards():
    """Dynamo evaluates only the guards that tell a function's compiled graphs apart (raising if none fits)."""
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
