"""The "hf_paged" attention function and its mask function, registered with transformers.

``paged_attention_forward`` reads a paged layer's pages in place when it receives `PagedKV`
handles, and computes ordinary attention on plain tensors (no cache, `DynamicCache`), so a model
loaded with ``attn_implementation="hf_paged"`` works with any cache.

The mask is transformers' own boolean SDPA mask (padding, causal, sliding window), sized by the
cache's ``get_mask_sizes``; it is registered too, since without it a left-padded batch would
silently lose its padding mask. Its last column is always the newest token, which is how the
paged path aligns it with the tokens a row still holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from .kernels import cpu_paged_attention as cpu_kernel
from .kernels.reference import LEAVE_OUT_FLOOR
from .model_config import ATTN_IMPLEMENTATION
from .paged_kv import PagedKV, PagedView

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
    heads itself, ``page_mass_heads``), or the "output" signal where it measures it (the C kernel, pages of one
    token); otherwise `_observe_tail` measures it on the live pages."""
    page_table, page_pos, q_pos = view.kernel_index()
    in_c = kernel is cpu_kernel.paged_attention_cpu
    mask_offset = 0
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask == 0
        mask_offset = view.num_tokens - attention_mask.shape[-1]
    observed = view.report_usage is not None and query.shape[2] <= view.observed_queries  # every query is observed
    output = view.usage_signal == "output"
    measured = observed and (not output or (in_c and view.page_size == 1))
    options = {}
    if measured and in_c:
        options["page_mass_heads"] = view.usage_heads
    if measured and output:
        options["page_mass_signal"] = "output"
    result = kernel(
        query, **view.pages.kernel_operands(), page_table=page_table, page_pos=page_pos, q_pos=q_pos, scale=scaling,
        mask=attention_mask, mask_offset=mask_offset, sliding_window=sliding_window, softcap=softcap, s_aux=s_aux,
        return_page_mass=measured, **options)
    if measured:
        out, page_mass = result
        view.report_usage(page_mass)
        return out
    if view.report_usage is not None:
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


def _add_page_usage(probs: torch.Tensor, out: torch.Tensor, values: torch.Tensor, view: PagedView) -> None:
    """Attention probabilities ``[B, Hkv, g, Q, T]`` of the observed queries over the live tokens, their outputs
    ``out [B, Q, Hq, D]`` and the tokens' ``values [B, T, Hkv, D]`` -> usage per live page ``[B, H, Nk]``, averaged
    over the queries, reported: the page's attention ``A``, or with the "output" signal how far it moves each
    head's output ``o``, ``‖Σ a·v − A·o‖ / (1 − A)`` (kernels/reference.py), from dot products: no ``[.., Nk, D]``
    tensor."""
    B, Hkv, g, Q, T = probs.shape
    S = view.page_size
    per_page = probs.reshape(B, Hkv, g, Q, T // S, S)
    mass = per_page.sum(-1)  # [B, Hkv, g, Q, Nk]
    if view.usage_signal == "output":
        v = values.float().transpose(1, 2)  # [B, Hkv, T, D]
        o = out.float().reshape(B, Q, Hkv, g, -1).permute(0, 2, 3, 1, 4)  # [B, Hkv, g, Q, D]
        v_dot_o = torch.matmul(o.reshape(B, Hkv, g * Q, -1), v.transpose(-1, -2)).reshape(B, Hkv, g, Q, T // S, S)
        v_gram = torch.matmul(v.reshape(B, Hkv, T // S, S, -1), v.reshape(B, Hkv, T // S, S, -1).transpose(-1, -2))
        moved_sq = torch.einsum("bhgqns,bhnst,bhgqnt->bhgqn", per_page, v_gram, per_page)  # ‖Σ a·v‖²
        moved_sq = moved_sq - 2 * mass * (per_page * v_dot_o).sum(-1) + mass ** 2 * (o * o).sum(-1)[..., None]
        mass = moved_sq.clamp(min=0).sqrt() / (1 - mass).clamp(min=LEAVE_OUT_FLOOR)
    view.report_usage(mass.mean(dim=3).reshape(B, Hkv * g, T // S))


def _observe_tail(query, keys, values, mask, view: PagedView, scaling, softcap, s_aux) -> None:
    """Usage from the attention of the step's last observed queries over ``keys [B, T, H, D]`` (live pages)."""
    w = view.observed_queries
    out, probs = attend(query[:, :, -w:], keys.transpose(1, 2), values.transpose(1, 2), mask[..., -w:, :], scaling,
                        softcap=softcap, s_aux=s_aux, return_probs=True)
    _add_page_usage(probs, out, values, view)


def _live_attention(query, view: PagedView, attention_mask, scaling, softcap, s_aux) -> torch.Tensor:
    """Rows with evicted pages (or a bounded cache tracking usage): attend over the gathered live pages."""
    keys, values, positions = view.read_live()
    mask = _live_mask(attention_mask, positions, view)
    whole = view.report_usage is not None and query.shape[2] <= view.observed_queries  # every query is observed
    result = attend(query, keys.transpose(1, 2), values.transpose(1, 2), mask, scaling, softcap=softcap,
                    s_aux=s_aux, return_probs=whole)
    if whole:
        out, probs = result
        _add_page_usage(probs, out, values, view)
        return out
    if view.report_usage is not None:
        _observe_tail(query, keys, values, mask, view, scaling, softcap, s_aux)
    return result


def _paged_attention(module, query, view: PagedView, attention_mask, scaling, sliding_window, softcap,
                     s_aux) -> torch.Tensor:
    """Read the layer's pages in place and attend; the mask is aligned on its last column."""
    if view.plan.packed:
        return _packed_attention(query, view, scaling, sliding_window, softcap, s_aux)
    kernel = _kernel_for(view, query.shape[2])
    if kernel is not None:
        return _kernel_attention(kernel, query, view, attention_mask, scaling, sliding_window, softcap, s_aux)
    if view.live_only:
        return _live_attention(query, view, attention_mask, scaling, softcap, s_aux)
    keys, values = view.read()
    return _attend_window(module, query, keys.transpose(1, 2), values.transpose(1, 2), attention_mask, scaling,
                          softcap, s_aux)


def _segment_attention(query, view: PagedView, segment, scaling, sliding_window, softcap, s_aux) -> torch.Tensor:
    """One sequence's new queries ``[1, Hq, L, D]`` over its gathered pages (causal, its own positions)."""
    total = segment.past + segment.length
    keys, values = view.pages.gather(segment.pages.to(view.pages.device))
    keys = keys.flatten(0, 1)[:total].transpose(0, 1).unsqueeze(0)  # [1, Hkv, total, D]
    values = values.flatten(0, 1)[:total].transpose(0, 1).unsqueeze(0)
    mask = None
    if segment.past or sliding_window:
        k_pos = torch.arange(total, device=query.device)
        q_pos = k_pos[segment.past:, None]
        mask = k_pos <= q_pos
        if sliding_window:
            mask &= q_pos - k_pos < sliding_window
    return attend(query, keys, values, mask, scaling, is_causal=mask is None, softcap=softcap, s_aux=s_aux)


def _packed_attention(query, view: PagedView, scaling, sliding_window, softcap, s_aux) -> torch.Tensor:
    """A packed step ``query [1, Hq, T, D]``: one-token segments (decode rows) in one paged-kernel call,
    prefill chunks each over their own pages. Returns ``[1, T, Hq, D]``."""
    step = view.plan
    kernel = _kernel_for(view, 1)
    outs, first = [], 0
    if kernel is not None and step.num_single:
        first = step.num_single
        singles = query[0, :, :first].transpose(0, 1).unsqueeze(2)  # [R, Hq, 1, D]
        out = _kernel_attention(kernel, singles, view, None, scaling, sliding_window, softcap, s_aux)
        outs.append(out.transpose(0, 1))  # [1, R, Hq, D]
    for segment in step.segments[first:]:
        q = query[:, :, segment.start:segment.start + segment.length]
        outs.append(_segment_attention(q, view, segment, scaling, sliding_window, softcap, s_aux))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


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
