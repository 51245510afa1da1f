"""The "hf_paged" attention function, its mask function, and what it reads: the `PagedKV` handles.

A paged layer's ``update`` (`PagedCache`'s rows of one batch, or `RaggedCache`'s sequences packed into
one row) returns, in place of concatenated keys / values, `PagedKV` tensors of the shape transformers
expects that hold no data of their own, only a `PagedView` of the layer in the current step: its
`LayerPages` (from the page store), the step's plan, the layer's backend and what eviction wants
measured. ``paged_attention_forward`` reads the pages in place through the view (one dispatch: a paged
kernel, `_kernel_for`, else SDPA on the pages) and sees nothing else of the cache; on plain tensors (no
cache, `DynamicCache`) it computes ordinary attention, so a model loaded with
``attn_implementation="hf_paged"`` works with any cache. Any other consumer of a `PagedKV` (another
attention implementation, a model that computes attention itself) triggers ``__torch_dispatch__``, which
materialises the window by reading the pages: the output stays correct, at the cost of one copy per
step, and a warning says so once.

The mask is transformers' own boolean SDPA mask (padding, causal, sliding window), sized by the
cache's ``get_mask_sizes``; it is registered too, since without it a left-padded batch would
silently lose its padding mask. Its last column is always the newest token, which is how the
paged path aligns it with the tokens a row still holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask
from transformers.utils import logging

from .compiled_many import RaggedRead
from .errors import CacheUsageError
from .eviction import page_usage
from .kernels import cpu_paged_attention as cpu_kernel
from .kernels.paged_attention_op import paged_attention as paged_attention_op
from .model_config import ATTN_IMPLEMENTATION
from .prefill_kernel import (prefill_kernel_applies, prefill_kernel_attention, rows_kernel_applies,
                             rows_prefill_attention)
from .segment_kv import causal_positions, segment_kv
from .shared_prefix import cascade_attention, cascade_decode, decode_cascade_applies, shared_prefix_groups

logger = logging.get_logger(__name__)


def warn_gathered_pages() -> None:
    """Say once per process that a PagedCache is read by another attention implementation.

    Called where that is first known: `PagedCache.bind_config` (the config names another attention)
    or the first read of a `PagedKV` by it; ``warning_once`` keeps it to one message for both.
    """
    logger.warning_once(
        "A PagedCache is being read by an attention implementation other than 'hf_paged': its pages are "
        "gathered every step, which is correct but slower. Load the model with attn_implementation='hf_paged' "
        "(after `import hf_paged`) to read them in place.")


@dataclass(frozen=True)
class PagedView:
    """What attention may read of one paged layer in one step.

    ``pages``: the layer's `LayerPages` (read through their kernel operands, `gather` or the float slab view);
    ``plan``: the step's plan on the pages' device (page tables, positions, lengths: a `StepPlan` of a batch's
    rows, or a `RaggedStep` of packed sequences); ``backend``: "torch", "triton" or "cpu", resolved once per
    layer; ``probe``: what an eviction policy that tracks usage wants measured (`hf_paged.eviction.UsageProbe`),
    or None; ``step_kv``: a packed step's own keys and values ``[1, Hkv, T, D]`` when its pages hold them bit for
    bit (float pages of their dtype), else None (read what the pages hold).
    """

    pages: object  # LayerPages
    plan: object  # StepPlan | RaggedStep
    backend: str
    probe: object = None  # UsageProbe | None
    step_kv: tuple | None = None  # (keys, values) | None

    @property
    def past(self) -> int:
        """Tokens cached before this step."""
        return self.plan.past

    @property
    def num_tokens(self) -> int:
        """Tokens cached after this step."""
        return self.plan.num_tokens

    @property
    def page_size(self) -> int:
        return self.plan.page_size

    @property
    def live_only(self) -> bool:
        """Rows are read through their live pages (they have holes, or usage is tracked)."""
        return self.plan.read_table is not None

    def has_holes(self) -> bool:
        """Some row lost pages to eviction."""
        return self.live_only and bool((self.plan.table < 0).any())

    def kernel_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page_table, page_pos, q_pos) for the paged kernels, checked against these pages."""
        return self.plan.kernel_index(self.pages.device, self.pages.num_pages)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' tokens as ``[B, T, H, D]`` (see `read_window`)."""
        return read_window(self.pages, self.plan)

    def read_live(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Live pages only: keys and values ``[B, Nk * S, H, D]`` gathered from the pages, and each
        token's position ``[B, Nk * S]`` (``num_tokens`` for padding and unwritten slots, which no
        query may attend)."""
        plan = self.plan
        table, page_pos = plan.live_pages()
        B, S = table.shape[0], plan.page_size
        keys, values = self.pages.gather(table.clamp(min=0))
        keys, values = keys.reshape(B, -1, *keys.shape[3:]), values.reshape(B, -1, *values.shape[3:])
        positions = (page_pos.unsqueeze(-1) + torch.arange(S, device=page_pos.device)).reshape(B, -1)
        positions = positions.masked_fill((table == -1).repeat_interleave(S, dim=1), plan.num_tokens)
        return keys, values, positions.clamp(max=plan.num_tokens)


class LayerRead:
    """What a layer's ``update`` may hand attention in place of keys and values when the layer reads its pages itself:
    `attend` returns ``[B, Q, Hq, Dv]`` (a compiled step's `CompiledRead`; `hf_paged.head_eviction.HeadRead`, the
    per-KV-head tables of ``PagedCache(per_head_eviction=True)``)."""

    def attend(self, query, attention_mask, scaling, sliding_window, softcap, s_aux) -> torch.Tensor:
        raise NotImplementedError


class CompiledRead(LayerRead):
    """What a compiled forward's attention reads of one paged layer in one step: its view's kernel operands and
    kernel index, tensors only, made before the forward's layers run (`PagedCache`'s compiled step begin) and
    returned by the layer's update in place of keys and values. Attention then calls one custom op
    (``hf_paged::paged_attention``): no Python decision, no tensor subclass inside the graph. The index's page
    axis and the pools' page axis are marked dynamic, so a row's new page or a grown pool is not a recompile."""

    def __init__(self, view: PagedView, slots: torch.Tensor):
        if view.probe is not None or view.plan.packed:
            raise CacheUsageError(
                "torch.compile with a PagedCache reads the pages through the paged kernel only: a bounded cache whose "
                "eviction observes attention ('score', 'lru') or generate_many's packed steps run eagerly. Use "
                "eviction='fifo' or 'error' (or no max_pages) under torch.compile, or do not compile the model.")
        self.view, self.slots = view, slots
        self.operands = view.pages.kernel_operands()
        if self.operands.get("cold") is not None:
            raise CacheUsageError("torch.compile reads one pool of pages per layer; a cache with cold_format keeps two "
                                  "tiers. Use cold_format=None under torch.compile, or do not compile the model.")
        self.index = view.kernel_index()
        for tensor in self.index:
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        for tensor in self.operands.values():
            if torch.is_tensor(tensor):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)

    def attend(self, query, attention_mask, scaling, sliding_window, softcap, s_aux) -> torch.Tensor:
        """``[B, Q, Hq, Dv]``: the queries over the layer's pages (the mask's last column is the newest token)."""
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask == 0
        operands = self.operands
        return paged_attention_op(query, operands["k_pool"], operands["v_pool"], *self.index, attention_mask, scaling,
                                  sliding_window, softcap, s_aux, operands["k_scale"], operands["v_scale"],
                                  operands["kv_format"], self.view.backend)


def read_window(pages, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``plan``'s rows, tokens ``[first_pos, num_tokens)``, as ``[B, T, H, D]``: a view when the
    rows lie on a slab of float pages, else a gather."""
    B, T = plan.batch_size, plan.kv_len
    slab_view = getattr(pages, "slab_view", None)  # a capability of float pages only
    if plan.slab is not None and slab_view is not None:
        return slab_view(*plan.slab, B, T)
    keys, values = pages.gather(plan.table)
    return keys.reshape(B, -1, *keys.shape[3:])[:, :T], values.reshape(B, -1, *values.shape[3:])[:, :T]


class PagedKV(torch.Tensor):
    """Keys (``which == "k"``) or values of one paged layer for the current step."""

    paged: PagedView
    which: str

    @staticmethod
    def __new__(cls, paged: PagedView, which: str, shape: tuple[int, ...]):
        tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=paged.pages.dtype, device=paged.pages.device)
        tensor.paged, tensor.which = paged, which
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    def materialize(self) -> torch.Tensor:
        """The ``[B, H, kv_len, D]`` window as a regular tensor (a view when pages allow)."""
        if self.paged.plan.packed:
            raise CacheUsageError(
                "generate_many packs sequences of different lengths into one row: only the 'hf_paged' attention "
                "can read them. Load the model with attn_implementation='hf_paged' (after `import hf_paged`).")
        if self.paged.has_holes():
            raise CacheUsageError(
                "This PagedCache evicted pages (a bounded pool with a lossy eviction policy): only the "
                "'hf_paged' attention can read rows with holes. Load the model with attn_implementation='hf_paged', "
                "or use eviction='error'.")
        keys, values = self.paged.read()
        warn_gathered_pages()
        return (keys if self.which == "k" else values).transpose(1, 2)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.materialize() if isinstance(t, PagedKV) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    def __repr__(self) -> str:
        return f"PagedKV({self.which}, shape={tuple(self.shape)}, backend={self.paged.backend!r})"


# The CPU kernel reads each slot once for all of a step's queries, scalar-ish per query: it wins for
# decoding and short continuations (assisted decoding); longer queries go to SDPA's blocked kernel.
CPU_KERNEL_MAX_QUERIES = 8


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool = False,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    return_probs: bool = False,
):
    """Attention of ``query [B, Hq, Q, D]`` over ``key/value [B, Hkv, T, D]`` (any strides).

    GQA reads each K/V head once (no repeat). ``mask`` is boolean (True = attend) or additive,
    broadcastable to ``[B, Hq, Q, T]``. Returns ``[B, Q, Hq, Dv]``, and with ``return_probs``
    also the attention probabilities ``[B, Hkv, Hq // Hkv, Q, T]`` (float32).
    """
    if softcap is None and s_aux is None and not return_probs:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=is_causal and mask is None, scale=scale,
            enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)
    B, Hq, Q, D = query.shape
    Hkv, T = key.shape[1], key.shape[2]
    groups = Hq // Hkv
    q = query.reshape(B, Hkv, groups * Q, D)  # heads of a KV group stacked along the query axis
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.view(B, Hkv, groups, Q, T)
    if is_causal and mask is None:
        mask = torch.ones(Q, T, dtype=torch.bool, device=query.device).tril(T - Q)
    if mask is not None:
        if mask.dim() == 4:  # [B, 1 or Hq, Q, T] -> broadcastable to [B, Hkv, groups, Q, T]
            heads = (1, 1) if mask.shape[1] == 1 else (Hkv, groups)
            mask = mask.reshape(mask.shape[0], *heads, *mask.shape[-2:])
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    if s_aux is not None:
        sinks = s_aux.float().view(1, Hkv, groups, 1, 1).expand(B, -1, -1, Q, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # a fully masked query row attends to nothing
    out = torch.matmul(probs.to(value.dtype).view(B, Hkv, groups * Q, T), value)
    out = out.view(B, Hq, Q, -1).transpose(1, 2)
    return (out, probs) if return_probs else out


def _kernel_for(view: PagedView, q_len: int):
    """The paged kernel that reads ``view``'s pages for queries of ``q_len`` tokens, or None (SDPA on the pages)."""
    if view.backend == "triton":
        from .kernels.triton_paged_attention import paged_attention_triton

        return paged_attention_triton
    if view.backend == "cpu" and q_len <= CPU_KERNEL_MAX_QUERIES:
        return cpu_kernel.paged_attention_cpu
    return None


def _kernel_attention(kernel, query, view: PagedView, attention_mask, scaling, sliding_window, softcap, s_aux):
    """A paged kernel walks the page table (holes included); the mask is aligned on its last column. When every
    query is observed the kernel also returns the usage per page: attention mass (the C kernel reduces it over the
    heads itself, ``page_mass_heads``, into the probe's buffer if it gives one: `UsageProbe.into`), or the "output"
    signal where it measures it (the C kernel, pages of one token); otherwise `_observe_tail` measures it on the live
    pages. A C kernel call with no mask and no sinks on float pages, and no usage or usage reduced into the probe's
    buffer, is a plain one (`cpu_paged_attention.plain_attention_cpu`: its checked arguments are reused)."""
    page_table, page_pos, q_pos = view.kernel_index()
    in_c = kernel is cpu_kernel.paged_attention_cpu
    probe = view.probe
    operands = view.pages.kernel_operands()
    plain = (in_c and attention_mask is None and s_aux is None and operands["kv_format"] == "float"
             and operands.get("cold") is None)
    if plain and probe is None:
        return cpu_kernel.plain_attention_cpu(query, operands["k_pool"], operands["v_pool"], page_table, page_pos,
                                              q_pos, scaling, sliding_window, softcap)
    mask_offset = 0
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask == 0
        mask_offset = view.num_tokens - attention_mask.shape[-1]
    observed = probe is not None and query.shape[2] <= probe.observed_queries  # every query is observed
    output = observed and probe.signal == "output"
    measured = observed and (not output or (in_c and view.page_size == 1))
    options = {}
    if measured and in_c:
        options["page_mass_heads"], options["page_mass_out"] = probe.heads, probe.into()
    if measured and output:
        options["page_mass_signal"] = "output"
    if plain and measured and options["page_mass_out"] is not None:  # a bounded cache's decode step
        usage = (probe.heads, options.get("page_mass_signal", "attention"), options["page_mass_out"])
        result = cpu_kernel.plain_attention_cpu(query, operands["k_pool"], operands["v_pool"], page_table, page_pos,
                                                q_pos, scaling, sliding_window, softcap, usage)
    else:
        result = kernel(
            query, **operands, page_table=page_table, page_pos=page_pos, q_pos=q_pos, scale=scaling,
            mask=attention_mask, mask_offset=mask_offset, sliding_window=sliding_window, softcap=softcap,
            s_aux=s_aux, return_page_mass=measured, **options)
    if measured:
        out, page_mass = result
        probe.report(page_mass)
        return out
    if probe is not None:
        keys, values, positions = view.read_live()
        _observe_tail(query, keys, values, _live_mask(attention_mask, positions, view), view, scaling, softcap,
                      s_aux)
    return result


def _live_mask(attention_mask: torch.Tensor | None, positions: torch.Tensor, view: PagedView) -> torch.Tensor:
    """Boolean mask ``[B, 1 or H, Q, T]`` over gathered live tokens at ``positions [B, T]``."""
    q_pos = torch.arange(view.past, view.num_tokens, device=positions.device)
    allowed = positions[:, None, None, :] <= q_pos[None, None, :, None]  # causal; padding slots excluded
    if attention_mask is None:
        return allowed
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0
    B, heads, Q, M = attention_mask.shape
    column = positions - (view.num_tokens - M)  # the mask's last column is the newest token
    index = column.clamp(0, M - 1)[:, None, None, :].expand(positions.shape[0], heads, Q, -1)
    picked = attention_mask.expand(positions.shape[0], heads, Q, M).gather(-1, index)
    return allowed & picked & (column >= 0)[:, None, None, :]


def _observe_tail(query, keys, values, mask, view: PagedView, scaling, softcap, s_aux) -> None:
    """Usage from the attention of the step's last observed queries over ``keys [B, T, H, D]`` (live pages)."""
    w = view.probe.observed_queries
    out, probs = attend(query[:, :, -w:], keys.transpose(1, 2), values.transpose(1, 2), mask[..., -w:, :], scaling,
                        softcap=softcap, s_aux=s_aux, return_probs=True)
    view.probe.report(page_usage(probs, out, values, view.page_size, view.probe.signal))


def _live_attention(query, view: PagedView, attention_mask, scaling, softcap, s_aux) -> torch.Tensor:
    """Rows with evicted pages (or a bounded cache tracking usage): attend over the gathered live pages."""
    keys, values, positions = view.read_live()
    mask = _live_mask(attention_mask, positions, view)
    whole = view.probe is not None and query.shape[2] <= view.probe.observed_queries  # every query is observed
    result = attend(query, keys.transpose(1, 2), values.transpose(1, 2), mask, scaling, softcap=softcap,
                    s_aux=s_aux, return_probs=whole)
    if whole:
        out, probs = result
        view.probe.report(page_usage(probs, out, values, view.page_size, view.probe.signal))
        return out
    if view.probe is not None:
        _observe_tail(query, keys, values, mask, view, scaling, softcap, s_aux)
    return result


def _paged_attention(module, query, view: PagedView, attention_mask, scaling, sliding_window, softcap,
                     s_aux) -> torch.Tensor:
    """Read the layer's pages in place and attend; the mask is aligned on its last column."""
    if view.plan.packed:
        return packed_attention(query, view, scaling, sliding_window, softcap, s_aux)
    kernel = _kernel_for(view, query.shape[2])
    if kernel is not None:
        return _kernel_attention(kernel, query, view, attention_mask, scaling, sliding_window, softcap, s_aux)
    if rows_kernel_applies(view, module, attention_mask, sliding_window, softcap, s_aux):
        return rows_prefill_attention(query, view, scaling)
    if view.live_only:
        return _live_attention(query, view, attention_mask, scaling, softcap, s_aux)
    keys, values = view.read()
    return _attend_window(module, query, keys.transpose(1, 2), values.transpose(1, 2), attention_mask, scaling,
                          softcap, s_aux)


def _segment_attention(query, view: PagedView, segment, scaling, sliding_window, softcap, s_aux) -> torch.Tensor:
    """One sequence's new queries ``[1, Hq, L, D]`` over its gathered pages (causal, its own positions), from its
    first page still held (the ones before left the sliding window). A sequence with no past reads its keys and
    values from the step itself when the view has them (``step_kv``: what its pages hold, bit for bit)."""
    first = segment.first_page * view.plan.page_size
    keys, values = segment_kv(view, segment, first)
    mask = None
    if segment.past or sliding_window:
        k_pos, q_pos = causal_positions(segment, first, query.device)
        mask = k_pos <= q_pos
        if sliding_window:
            mask &= q_pos - k_pos < sliding_window
    return attend(query, keys, values, mask, scaling, is_causal=mask is None, softcap=softcap, s_aux=s_aux)


def packed_attention(query, view: PagedView, scaling, sliding_window, softcap, s_aux) -> torch.Tensor:
    """A packed step ``query [1, Hq, T, D]``: one-token segments (decode rows) in one paged-kernel call, or rows that
    share a long cached prefix through it (`shared_prefix.cascade_decode`); prefill chunks in one C-kernel call where
    it applies (`prefill_kernel`: float pages on the CPU, no window, softcap or sinks), else each over its own pages,
    rows that share a cached prefix through it (`shared_prefix.cascade_attention`). Returns ``[1, T, Hq, D]``."""
    step = view.plan
    kernel = _kernel_for(view, 1)
    outs, first = {}, 0
    cascade = step.shared_start and view.pages.device.type == "cpu" and not (
        sliding_window or softcap or s_aux is not None)
    if kernel is not None and step.num_single:
        first = step.num_single
        singles = query[0, :, :first].transpose(0, 1).unsqueeze(2)  # [R, Hq, 1, D]
        groups = (shared_prefix_groups(step, decode=True)
                  if cascade and kernel is cpu_kernel.paged_attention_cpu and decode_cascade_applies(view) else None)
        if groups:
            out = cascade_decode(singles, view, groups, scaling)
        else:
            out = _kernel_attention(kernel, singles, view, None, scaling, sliding_window, softcap, s_aux)
        outs[-1] = out.transpose(0, 1)  # [1, R, Hq, D]
    if first < len(step.segments) and prefill_kernel_applies(view, sliding_window, softcap, s_aux):
        out = prefill_kernel_attention(query, view, first, scaling)
        if first:
            out[:, :first] = outs[-1]
        return out.to(query.dtype)
    if cascade:
        for shared, members in shared_prefix_groups(step):
            chunks = [step.segments[i] for i in members]
            outs.update(zip(members, cascade_attention(query, view, chunks, shared, scaling)))
    for i in range(first, len(step.segments)):
        if i not in outs:
            segment = step.segments[i]
            q = query[:, :, segment.start:segment.start + segment.length]
            outs[i] = _segment_attention(q, view, segment, scaling, sliding_window, softcap, s_aux)
    parts = [outs[i] for i in sorted(outs)]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _attend_window(module, query, key, value, attention_mask, scaling, softcap, s_aux) -> torch.Tensor:
    """`attend` over ``key/value [B, Hkv, T, D]``; the mask covers exactly those T tokens (transformers sizes it
    by the cache's ``get_mask_sizes``, which a paged layer answers with the window it reads)."""
    is_causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    return attend(query, key, value, attention_mask, scaling, is_causal=is_causal, softcap=softcap, s_aux=s_aux)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: returns ``(attn_output [B, Q, H, D], None)``."""
    if dropout and module.training:
        raise NotImplementedError("hf_paged attention is for inference: dropout is not supported.")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if isinstance(key, RaggedRead):
        return key.attend(query, scaling, sliding_window, softcap, s_aux), None
    if isinstance(key, LayerRead):
        return key.attend(query, attention_mask, scaling, sliding_window, softcap, s_aux), None
    if isinstance(key, PagedKV):
        out = _paged_attention(module, query, key.paged, attention_mask, scaling, sliding_window, softcap, s_aux)
        return out, None
    return _attend_window(module, query, key, value, attention_mask, scaling, softcap, s_aux), None


def register() -> None:
    """Register ``"hf_paged"`` with transformers' attention and mask interfaces (idempotent).

    The mask is transformers' own boolean SDPA mask (None when a plain causal pattern suffices).
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
