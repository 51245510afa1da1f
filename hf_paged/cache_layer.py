"""`PagedLayer`: one decoder layer's K/V page pools, a `CacheLayerMixin` for transformers.

Pools are ``[num_pages, page_size, kv_heads, head_dim]`` tensors allocated lazily on the device
and dtype of the first key seen (so ``device_map`` puts each layer's pages on its device). Page
ids come from the layer's `PageGroup`, shared by every layer of the group; a layer only writes
the slots its group planned and reads its rows back as a view or a gather.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .backends import layer_backend
from .errors import CacheUsageError
from .page_group import PageGroup
from .paged_kv import PagedKV, read_window


def _identical_rows(keys: torch.Tensor, values: torch.Tensor) -> list[int]:
    """``same_as[b]``: the first row of the run of consecutive rows identical to row b."""
    same_prev = ((keys[1:] == keys[:-1]).flatten(1).all(1) & (values[1:] == values[:-1]).flatten(1).all(1))
    same_as = [0]
    for b, same in enumerate(same_prev.tolist(), start=1):
        same_as.append(same_as[-1] if same else b)
    return same_as


class PagePool:
    """The K and V page tensors of one layer, shared by every fork of a cache."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._rows: tuple = (None, None, None, None, None)  # (keys, values, grad mode, key rows, value rows)

    def grow_to(self, num_pages: int) -> None:
        """Grow both tensors to ``num_pages`` pages, keeping their content (callers' managers grow
        geometrically, so this is amortised); new pages are zeros, never NaN: masked slots are multiplied by 0."""
        have = self.keys.shape[0]
        if have >= num_pages:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((num_pages, *old.shape[1:]))
            new[:have] = old
            setattr(self, name, new)

    def slot_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys``/``values`` as ``[pages * page_size, heads, dim]``, one row per slot: views made once per
        pool tensor and grad mode (autograd forbids writing, with grad on, into a view made under no_grad)."""
        keys, values, grad, key_rows, value_rows = self._rows
        if keys is not self.keys or values is not self.values or grad != torch.is_grad_enabled():
            key_rows, value_rows = self.keys.flatten(0, 1), self.values.flatten(0, 1)
            self._rows = (self.keys, self.values, torch.is_grad_enabled(), key_rows, value_rows)
        return key_rows, value_rows

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy pages ``src`` onto pages ``dst`` in both tensors."""
        self.keys[dst] = self.keys[src]
        self.values[dst] = self.values[src]


class PagedLayer(CacheLayerMixin):
    """K/V pools of one layer, a member of its `PageGroup` (which counts the tokens the layer wrote)."""

    keys = property(lambda self: self.pool.keys, lambda self, t: setattr(self.pool, "keys", t))
    values = property(lambda self: self.pool.values, lambda self, t: setattr(self.pool, "values", t))

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, group: PageGroup, layer_idx: int, backend: str | None = None, pool: PagePool | None = None):
        self.pool = pool or PagePool()  # CacheLayerMixin.__init__ would reset a shared pool: not called
        self.is_initialized = False
        if self.pool.keys is not None:
            self._adopt_pool()
        self.group = group
        self.backend = backend  # "cpu" | "torch" | "triton" | "auto" | None (= $HF_PAGED_BACKEND)
        self._resolved_backend: str | None = None  # what `backend` means for these pools, resolved on first use
        self.layer_idx = layer_idx
        self.is_sliding = group.sliding_window is not None
        self.sliding_window = group.sliding_window
        group.members.join(self)

    def fork(self, group: PageGroup) -> "PagedLayer":
        """A layer of a forked cache: same pool tensors, the fork's own page tables."""
        twin = PagedLayer(group, self.layer_idx, self.backend, self.pool)
        group.members.join(twin, self.get_seq_length())
        return twin

    def __repr__(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.is_sliding else ""
        return f"PagedLayer({self.layer_idx}{window})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the pools for these keys, unless a fork of this cache already did (the pools are shared)."""
        if self.keys is None:
            S = self.group.page_size
            self.keys = key_states.new_empty((0, S, key_states.shape[1], key_states.shape[3]))
            self.values = value_states.new_empty((0, S, value_states.shape[1], value_states.shape[3]))
        self._adopt_pool()

    def _adopt_pool(self) -> None:
        """Take dtype, device and shapes from the pools: every later update must match them."""
        self.dtype, self.device = self.keys.dtype, self.keys.device
        self.num_heads, self.head_dim, self.value_dim = self.keys.shape[2], self.keys.shape[3], self.values.shape[3]
        self._signature = (self.num_heads, self.head_dim, self.value_dim, self.dtype, self.dtype, self.device,
                           self.device)
        self.is_initialized = True

    # ------------------------------------------------------------------ write
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new tokens into their slots; return `PagedKV` handles (no copy of the cache)."""
        if not self.is_initialized:
            self._check_shapes(key_states, value_states)
            self.lazy_initialization(key_states, value_states)
        self._check(key_states, value_states)
        if self._resolved_backend is None:
            self._resolved_backend = layer_backend(self.backend, self.device, self.dtype)
        batch, _, q_len, _ = key_states.shape
        group = self.group
        plan = group.join_step(self, batch, q_len, lambda: _identical_rows(key_states, value_states))
        if plan.same_as is not None:
            self._check_identical_rows(key_states, value_states, plan.same_as)
        plan = group.step.on(self.device)  # rebuilt if rows had to be unshared
        self.pool.grow_to(group.manager.num_pages)
        if plan.copy_src is not None:
            self.pool.copy_pages(plan.copy_src, plan.copy_dst)
        if q_len > 1:  # token-major [B, q, H, D], the order of plan.slots (with one token it already is)
            key_states, value_states = key_states.transpose(1, 2), value_states.transpose(1, 2)
        key_rows, value_rows = self.pool.slot_rows()
        key_rows.index_copy_(0, plan.slots, key_states.reshape(-1, self.num_heads, self.head_dim))
        value_rows.index_copy_(0, plan.slots, value_states.reshape(-1, self.num_heads, self.value_dim))
        group.wrote(self)
        view = group.read_view(self.keys, self.values, self._resolved_backend)
        shape = (batch, self.num_heads, plan.kv_len)
        return PagedKV(view, "k", (*shape, self.head_dim)), PagedKV(view, "v", (*shape, self.value_dim))

    def _check_identical_rows(self, key_states: torch.Tensor, value_states: torch.Tensor, same_as: list[int]) -> None:
        """Rows the group shares because the first layer saw identical keys must be identical here too."""
        source = torch.tensor(same_as, device=key_states.device)
        differ = ((key_states != key_states[source]).flatten(1).any(1)
                  | (value_states != value_states[source]).flatten(1).any(1)).nonzero().flatten().tolist()
        if differ:  # rare (identical tokens, different masks): give those rows their own pages
            self.group.unshare(differ)

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, copy) page pair of this layer's pools (the group unshared rows mid-step)."""
        self.pool.grow_to(self.group.manager.num_pages)
        self.pool.copy_pages(*(torch.tensor(side, device=self.device) for side in zip(*pairs)))

    def _check_shapes(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() != 4 or value_states.dim() != 4 or key_states.shape[:3] != value_states.shape[:3]:
            raise CacheUsageError(
                f"layer {self.layer_idx}: keys and values must be [batch, kv_heads, tokens, head_dim] with "
                f"matching leading sizes, got {tuple(key_states.shape)} and {tuple(value_states.shape)}."
            )

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._check_shapes(key_states, value_states)
        got = (key_states.shape[1], key_states.shape[3], value_states.shape[3], key_states.dtype,
               value_states.dtype, key_states.device, value_states.device)
        want = self._signature
        if got != want:
            names = ("kv heads", "key head dim", "value head dim", "key dtype", "value dtype", "key device",
                     "value device")
            diffs = ", ".join(f"{n} {g} (pool has {w})" for n, g, w in zip(names, got, want) if g != w)
            fix = ("This cache holds no tokens: call cache.bind_config(model.config) to serve the new model with it "
                   "(reset() keeps the pools of the model it served), or use a new cache."
                   if self.group.num_tokens == 0 and not self.group.rows else
                   "A PagedCache serves one model in one dtype and device placement: call cache.reset() and then "
                   "cache.bind_config(model.config), or use a new cache for another model, or cast the model "
                   "instead of the cache.")
            raise CacheUsageError(f"layer {self.layer_idx}: new keys/values do not match this layer's page pool: "
                                  f"{diffs}. {fix}")

    # ------------------------------------------------------------------- read
    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' tokens ``[first_pos, num_tokens)`` as ``[B, T, H, D]``: a view on a slab, else a gather."""
        plan = self.group.step.on(self.device)
        return read_window(self.keys, plan), read_window(self.values, plan)

    # ------------------------------------------------------------ transformers
    def get_seq_length(self) -> int:
        """Tokens this layer has processed: mid-step, a layer that has not written yet still reports
        the tokens before the step, as a `DynamicCache` layer does (Llama 4 asks before writing)."""
        return self.group.members[self]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.group.mask_sizes(query_length)

    def get_max_length(self) -> int:
        return -1

    def activate_past_recording(self, **recurrent_options) -> None:
        """Assisted decoding: keep sliding-window pages until the next `crop` (it may roll back).

        ``recurrent_options`` (transformers >= 5.25 passes ``recurrent_states_to_keep``) concern
        linear-attention layers only; attention pages ignore them."""
        self.group.record_past = True

    def reset(self) -> None:
        """Forget this layer's tokens (it rejoins its group with none); the pools are kept for reuse."""
        self.group.members.join(self)

    def offload(self):
        raise NotImplementedError("PagedCache does not offload layers; bound it with max_pages instead.")

    prefetch = offload
