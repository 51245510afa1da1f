"""`torch.compile` with a `PagedCache`: each step is planned before the compiled forward runs.

A paged step's planning is Python (the block manager, page tables, copy-on-write): inside a compiled forward it
would be a graph break in the first layer, and Dynamo would then compile the layers frame by frame. So a forward
pre-hook (`plan_compiled_steps`) plans the step of the `PagedCache` a forward is given, before the forward, for every
layer at once (`CompiledSteps.begin_compiled_step`); inside the graph each layer only writes its new keys and values
into their slots (the ``hf_paged::write_slots`` op) and attends through the ``hf_paged::paged_attention`` op. The
custom ops run in eager forwards too, so a forward Dynamo leaves uncompiled gives the same tokens.

    compiled = torch.compile(hf_paged.plan_compiled_steps(model))     # a forward loop: compiled(ids, cache=cache)
    model.forward = torch.compile(model.forward)                       # or generate (the hook stays on the model)
    model.generate(**inputs, cache=hf_paged.PagedCache(config=model.config))

A plain ``torch.compile(model)`` gives the same tokens, but without the hook each forward plans its step in its first
layer (a graph break), and the layers are compiled one by one.
"""

from __future__ import annotations

import threading

import torch

from .errors import CacheUsageError
from .model_config import kv_heads_and_dim


class CompiledSteps:
    """What a `PagedCache` does for compiled forwards: steps planned before the forward, layers that only write their
    slots and return their `CompiledRead` (and, with no hook, layer 0 planning the step outside the graph)."""

    _plans_ahead = False  # a hook plans this cache's steps before each forward: every update takes this path
    _compiled_step_planned = False  # ... and planned the step of the forward that runs now (until its layer 0)

    def _update_compiled(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """`update` inside a compiled forward: each layer only writes its slots (a custom op) and returns its
        `CompiledRead`; the step was planned before the forward (`plan_compiled_steps`' hook), else layer 0 plans it
        here, outside the graph (a graph break: correct, but Dynamo then compiles the layers one by one)."""
        if layer_idx == 0:
            if not self._compiled_step_planned:
                self._plan_compiled_step_here(key_states, value_states)
            self._compiled_step_planned = False
        layer = self.layers[layer_idx]
        heads = key_states.shape[1]
        if key_states.shape[2] > 1:  # token-major [B, q, H, D], the order of the plan's slots
            key_states, value_states = key_states.transpose(1, 2), value_states.transpose(1, 2)
        layer.pages.write_in_graph(layer.compiled.slots, key_states.reshape(-1, heads, key_states.shape[-1]),
                                   value_states.reshape(-1, heads, value_states.shape[-1]))
        return layer.compiled, layer.compiled

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self._compiled_step_planned:  # (asked before the planned step's layers run: the tokens before it)
            return self.layers[layer_idx].compiled_sizes[0]
        return super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if self._compiled_step_planned:
            return self.layers[layer_idx].compiled_sizes[1]
        self._drop_failed_step(layer_idx)  # (`PagedCache`'s: a query from a new forward after a failed step)
        return super().get_mask_sizes(query_length, layer_idx)

    @torch.compiler.disable
    def _plan_compiled_step_here(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.begin_compiled_step(key_states.shape[0], key_states.shape[2], key_states, value_states)

    def begin_compiled_step(self, batch: int, q_len: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Plan a compiled forward's step of ``q_len`` tokens for ``batch`` rows in every layer at once
        (`PagedLayer.begin_compiled`), as the eager updates would; ``keys``/``values`` (``[1, kv_heads, 0, dim]``
        suffice) shape the pages of layers that have none yet. The step is final when the next one begins
        (`commit`); planning that fails rolls back."""
        if self.config is None:
            raise CacheUsageError("torch.compile with a PagedCache needs a cache that knows the model's layers: make "
                                  "it with PagedCache(config=model.config) (or call cache.bind_config(model.config)).")
        if self.kv_format != "float":
            raise CacheUsageError(f"plan_compiled_steps writes float pages only, and this cache has "
                                  f"kv_format={self.kv_format!r}: use kv_format='float' with torch.compile, or run "
                                  "quantized pages without plan_compiled_steps.")
        if self._owner.ident != threading.get_ident():
            self._owner.claim()
        if self._compiled_step_planned:
            self.rollback()  # the step planned last never ran: its forward failed before the first layer
        self.commit()
        try:
            for layer in self.layers:
                layer.begin_compiled(batch, q_len, keys, values)
        except Exception:
            self._compiled_step_planned = False
            self.rollback()
            raise
        self._plans_ahead = self._compiled_step_planned = True


_HOOKED = "_hf_paged_plans_steps"  # attribute of a model that carries the hook


def plan_compiled_steps(model: torch.nn.Module) -> torch.nn.Module:
    """Register (once) the forward pre-hook that plans the step of a `PagedCache` given to ``model``'s forwards;
    returns ``model`` (to compile: ``torch.compile(plan_compiled_steps(model))``)."""
    if not getattr(model, _HOOKED, False):
        model.register_forward_pre_hook(_plan_before_forward, with_kwargs=True)
        setattr(model, _HOOKED, True)
    return model


@torch.compiler.disable  # (under torch.compile(model), which traces hooks too: a break before the forward)
def _plan_before_forward(module: torch.nn.Module, args, kwargs):
    """Plan the step of the PagedCache given to this forward, for every layer, before the forward runs."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, CompiledSteps):
        return None
    inputs = kwargs.get("input_ids", args[0] if args else None)
    if inputs is None:
        inputs = kwargs["inputs_embeds"]
    heads, head_dim = kv_heads_and_dim(module.config)
    parameter = next(module.parameters())
    keys = torch.empty(1, heads, 0, head_dim, dtype=parameter.dtype, device=parameter.device)
    cache.begin_compiled_step(inputs.shape[0], inputs.shape[1], keys, keys)
    return None
