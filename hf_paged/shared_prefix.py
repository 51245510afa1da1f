"""Cascade attention for the rows of a packed step whose sequences begin with the same cached pages.

Sequences that share a prefix (a system prompt cached once, its pages shared by reference) read the same keys and
values for those pages. Instead of reading them once per sequence, the rows of a group attend over the shared
prefix in ONE unmasked flash-attention call (the prefix read once: a view of the pool when its pages are
consecutive, else gathered), and each over its own remaining tokens; the two parts are merged exactly by their
log-sum-exp: ``out = own + (prefix - own) * sigmoid(lse_prefix - lse_own)``. Prefill chunks
(`cascade_attention`): each chunk's own part is one causal flash call; on the CPU the C prefill kernel
(`hf_paged.prefill_kernel`) takes the chunks first, so they come here from pages it does not read (two tiers,
fp8, another device, a window, softcap or sinks). Decode rows
(`cascade_decode`): their own parts are one C-kernel call over each row's pages after the prefix, which returns the
log-sum-exp too.

Invariants: a group's shared pages are the same page ids, leading every member's table, and lie wholly in every
member's past (full pages: their contents are what every member attends); rows outside any group, a sliding
window, a softcap or attention sinks keep the per-row paths (`attention._segment_attention`, the paged kernel).
"""

from __future__ import annotations

import torch

from .kernels import cpu_paged_attention as cpu_kernel
from .page_tables import kernel_index
from .segment_kv import causal_positions, segment_kv

# When a group pays (SmolLM2, 1 thread: docs/many_prompts.md, "Cascade attention"): prefill chunks sharing 512
# tokens (one layer's attention: at 64-256 the per-chunk path was as fast or faster); decode rows sharing 2048
# tokens, 8192 row-tokens (compiled system-prompt passes, the C kernel's float walk: at 512 and 1024 shared tokens
# the decode steps' attention cost more with the cascade than without, at 2048 less).
PREFILL_MIN_TOKENS, PREFILL_MIN_CHUNKS = 512, 2
DECODE_MIN_TOKENS, DECODE_MIN_ROW_TOKENS = 2048, 8192

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def shared_prefix_groups(step, decode: bool = False) -> list[tuple[int, list[int]]]:
    """``(shared pages n, member segment indices)`` of ``step``'s prefill chunks (``segments[num_single:]``), or with
    ``decode`` its decode rows (``segments[:num_single]``): rows whose tables begin with the same ``n`` page ids, all
    in their past, as many as pay (`PREFILL_MIN_TOKENS` and `PREFILL_MIN_CHUNKS`; `DECODE_MIN_TOKENS` and
    `DECODE_MIN_ROW_TOKENS`). Planned once per step (kept in the step's memo)."""
    min_tokens, min_rows, min_work = ((DECODE_MIN_TOKENS, 2, DECODE_MIN_ROW_TOKENS) if decode
                                      else (PREFILL_MIN_TOKENS, PREFILL_MIN_CHUNKS, 0))
    key = ("shared_prefix", decode, min_tokens, min_rows, min_work)
    groups = step._on_device.get(key)
    if groups is not None:
        return groups
    S, by_first = step.page_size, {}
    for i in range(step.num_single) if decode else range(step.num_single, len(step.segments)):
        segment = step.segments[i]
        if segment.first_page == 0 and segment.past >= max(min_tokens, S):
            by_first.setdefault(int(segment.pages[0]), []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) < min_rows:
            continue
        tables = [step.segments[i].pages[:step.segments[i].past // S] for i in members]
        n = min(len(t) for t in tables)
        for table in tables[1:]:
            differ = (table[:n] != tables[0][:n]).nonzero()
            n = int(differ[0]) if len(differ) else n
        if n * S >= min_tokens and len(members) * n * S >= min_work:
            groups.append((n, members))
    step._on_device[key] = groups
    return groups


def _prefix_kv(view, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[1, Hkv, n * S, D]`` of the ``n`` shared ``pages``: a view of float pools when the page ids
    are consecutive (looked at once per step), else gathered."""
    operands = view.pages.kernel_operands()
    first, memo = int(pages[0]), view.plan._on_device
    consecutive = memo.get(("consecutive", first, len(pages)))
    if consecutive is None:
        consecutive = memo[("consecutive", first, len(pages))] = bool(
            (pages == torch.arange(first, first + len(pages))).all())
    if consecutive and operands["kv_format"] == "float" and operands.get("cold") is None:
        pools = (operands["k_pool"][first:first + len(pages)], operands["v_pool"][first:first + len(pages)])
    else:
        pools = view.pages.gather(pages.to(view.pages.device))
    return tuple(t.flatten(0, 1).transpose(0, 1).unsqueeze(0) for t in pools)


def _unmasked(query, keys, values, scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked flash attention of ``query [1, Hq, M, D]`` over ``keys/values [1, Hkv, T, D]``: output ``[1, Hq, M,
    Dv]`` and log-sum-exp ``[1, Hq, M]``. The query heads of a KV head are stacked along the query axis (no mask
    tells them apart): fewer, larger blocks, the same result."""
    Hq, M = query.shape[1], query.shape[2]
    Hkv = keys.shape[1]
    out, lse = _flash(query.reshape(1, Hkv, Hq // Hkv * M, -1), keys, values, 0.0, False, scale=scaling)
    return out.reshape(1, Hq, M, -1), lse.reshape(1, Hq, M)


def _merge(own, own_lse, prefix, prefix_lse) -> torch.Tensor:
    """Attention over two disjoint sets of tokens merged by their log-sum-exp (``*_lse`` shaped as ``own`` without
    its last axis), in float32."""
    weight = torch.sigmoid(prefix_lse - own_lse).unsqueeze(-1)
    own = own.float()
    return own + (prefix.float() - own) * weight


def _own_part(query, view, segment, shared: int, scaling):
    """``segment``'s queries ``[1, Hq, L, D]`` over its tokens from position ``shared`` on (causal): output
    ``[1, Hq, L, D]`` and log-sum-exp ``[1, Hq, L]`` (float32)."""
    keys, values = segment_kv(view, segment, shared)
    if segment.past == shared:
        return _flash(query, keys, values, 0.0, True, scale=scaling)
    k_pos, q_pos = causal_positions(segment, shared, query.device)
    mask = torch.zeros((len(q_pos), len(k_pos)), dtype=query.dtype, device=query.device)
    mask.masked_fill_(k_pos > q_pos, float("-inf"))
    return _flash(query, keys, values, 0.0, False, attn_mask=mask, scale=scaling)


def cascade_attention(query, view, members: list, shared_pages: int, scaling) -> list[torch.Tensor]:
    """``[1, L, Hq, Dv]`` of each chunk in ``members`` (segments, in packed order), whose tables begin with the same
    ``shared_pages`` pages: the prefix part in one call for all of them, merged with each one's own part."""
    S = view.plan.page_size
    keys, values = _prefix_kv(view, members[0].pages[:shared_pages])
    first, last = members[0], members[-1]
    if last.start + last.length - first.start == sum(s.length for s in members):  # contiguous: a view
        q = query[:, :, first.start:last.start + last.length]
    else:
        q = torch.cat([query[:, :, s.start:s.start + s.length] for s in members], dim=2)
    prefix_out, prefix_lse = _unmasked(q, keys, values, scaling)
    own = [_own_part(query[:, :, s.start:s.start + s.length], view, s, shared_pages * S, scaling) for s in members]
    own_out = torch.cat([o for o, _ in own], dim=2) if len(own) > 1 else own[0][0]
    own_lse = torch.cat([lse for _, lse in own], dim=2) if len(own) > 1 else own[0][1]
    merged = _merge(own_out, own_lse, prefix_out, prefix_lse)  # [1, Hq, sum L, Dv]
    merged = merged.to(query.dtype).transpose(1, 2)
    return list(merged.split([s.length for s in members], dim=1))


def decode_cascade_applies(view) -> bool:
    """The decode rows' own parts can run in the C kernel with its log-sum-exp (float pages of one tier)."""
    operands = view.pages.kernel_operands()
    return operands["kv_format"] == "float" and operands.get("cold") is None and view.probe is None


def cascade_decode(singles, view, groups: list[tuple[int, list[int]]], scaling) -> torch.Tensor:
    """Decode rows ``singles [R, Hq, 1, D]`` (``segments[:R]`` of the step) over their pages, ``groups`` of them
    (`shared_prefix_groups` with ``decode``) through the shared prefix: one C-kernel call over each row's pages after
    its group's prefix (all its pages for a row in no group), one flash call per group over its prefix, merged.
    Returns ``[R, 1, Hq, D]`` (in the query's dtype)."""
    step = view.plan
    operands = view.pages.kernel_operands()
    index = kernel_index(step._on_device, view.pages.device, view.pages.num_pages,
                         lambda: _own_rows(step, groups), "cascade_kernel")
    out, lse = cpu_kernel.plain_attention_cpu(singles, operands["k_pool"], operands["v_pool"], *index, scaling,
                                              return_lse=True)  # [R, 1, Hq, D], [R, 1, Hq]
    for shared, members in groups:
        keys, values = _prefix_kv(view, step.segments[members[0]].pages[:shared])
        rows = slice(members[0], members[-1] + 1) if members[-1] - members[0] == len(members) - 1 else members
        q = singles[rows, :, 0].transpose(0, 1).unsqueeze(0)  # [1, Hq, M, D]: the rows as queries of one sequence
        prefix_out, prefix_lse = _unmasked(q.to(keys.dtype), keys, values, scaling)
        out[rows, 0] = _merge(out[rows, 0], lse[rows, 0], prefix_out[0].transpose(0, 1), prefix_lse[0].transpose(0, 1))
    return out


def _own_rows(step, groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(page_table [R, N], page_pos [R, N], q_pos [R, 1]) of the decode rows' pages after their group's prefix."""
    shared = [0] * step.num_single
    for n, members in groups:
        for i in members:
            shared[i] = n
    singles = step.segments[:step.num_single]
    width = max(len(s.pages) - n for s, n in zip(singles, shared))
    table = torch.full((len(singles), width), -1, dtype=torch.long)
    for r, (s, n) in enumerate(zip(singles, shared)):
        table[r, :len(s.pages) - n] = s.pages[n:]
    page_pos = (torch.arange(width) + torch.tensor(shared)[:, None]) * step.page_size
    return table, page_pos, torch.tensor([[s.past] for s in singles])
