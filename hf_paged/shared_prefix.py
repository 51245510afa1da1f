"""Cascade attention for the prefill chunks of a packed step whose sequences begin with the same cached pages.

Chunks of sequences that share a prefix (a system prompt cached once, its pages shared by reference) read the
same keys and values for those pages. Instead of one masked SDPA per chunk over all its pages, the chunks of a
group attend over the shared prefix in ONE unmasked flash-attention call (the prefix gathered once), and each
over its own remaining tokens causally; the two parts are merged exactly by their log-sum-exp:
``out = own + (prefix - own) * sigmoid(lse_prefix - lse_own)``.

Invariants: a group's shared pages are the same page ids, leading every member's table, and lie wholly in every
member's past (full pages: their contents are what every member attends); a chunk outside any group, a sliding
window, a softcap or attention sinks keep the per-chunk path (`attention._segment_attention`).
"""

from __future__ import annotations

import torch

# A group pays when its chunks share at least this many tokens (measured: docs/many_prompts.md, "Cascade attention").
MIN_SHARED_TOKENS = 128
MIN_CHUNKS = 2

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def shared_prefix_groups(step) -> list[tuple[int, list[int]]]:
    """``(shared pages n, member segment indices)`` of ``step``'s prefill chunks (``segments[num_single:]``): chunks
    whose tables begin with the same ``n`` page ids, all in their past, ``n * page_size >= MIN_SHARED_TOKENS``, at
    least `MIN_CHUNKS` of them. Planned once per step (kept in the step's memo)."""
    min_tokens = MIN_SHARED_TOKENS
    key = ("shared_prefix", min_tokens)
    groups = step._on_device.get(key)
    if groups is not None:
        return groups
    S, by_first = step.page_size, {}
    for i in range(step.num_single, len(step.segments)):
        segment = step.segments[i]
        if segment.first_page == 0 and segment.past >= max(min_tokens, S):
            by_first.setdefault(int(segment.pages[0]), []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) < MIN_CHUNKS:
            continue
        tables = [step.segments[i].pages[:step.segments[i].past // S] for i in members]
        n = min(len(t) for t in tables)
        for table in tables[1:]:
            differ = (table[:n] != tables[0][:n]).nonzero()
            n = int(differ[0]) if len(differ) else n
        if n * S >= min_tokens:
            groups.append((n, members))
    step._on_device[key] = groups
    return groups


def _own_part(query, view, segment, shared: int, scaling):
    """``segment``'s queries ``[1, Hq, L, D]`` over its tokens from position ``shared`` on (causal): output
    ``[1, Hq, L, D]`` and log-sum-exp ``[1, Hq, L]`` (float32)."""
    total = segment.past + segment.length
    if segment.past == shared and view.step_kv is not None:  # all its own tokens are in this step
        keys, values = (t[:, :, segment.start:segment.start + segment.length] for t in view.step_kv)
    else:
        first_page = shared // view.plan.page_size
        keys, values = view.pages.gather(segment.pages[first_page:].to(view.pages.device))
        keys = keys.flatten(0, 1)[:total - shared].transpose(0, 1).unsqueeze(0)  # [1, Hkv, total - shared, D]
        values = values.flatten(0, 1)[:total - shared].transpose(0, 1).unsqueeze(0)
    if segment.past == shared:
        return _flash(query, keys, values, 0.0, True, scale=scaling)
    k_pos = torch.arange(shared, total, device=query.device)
    allowed = k_pos <= k_pos[segment.past - shared:, None]
    mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(~allowed, float("-inf"))
    return _flash(query, keys, values, 0.0, False, attn_mask=mask, scale=scaling)


def cascade_attention(query, view, members: list, shared_pages: int, scaling) -> list[torch.Tensor]:
    """``[1, L, Hq, Dv]`` of each chunk in ``members`` (segments, in packed order), whose tables begin with the same
    ``shared_pages`` pages: the prefix part in one call for all of them, merged with each one's own part."""
    S = view.plan.page_size
    keys, values = view.pages.gather(members[0].pages[:shared_pages].to(view.pages.device))
    keys = keys.flatten(0, 1).transpose(0, 1).unsqueeze(0)  # [1, Hkv, shared_pages * S, D]
    values = values.flatten(0, 1).transpose(0, 1).unsqueeze(0)
    first, last = members[0], members[-1]
    if last.start + last.length - first.start == sum(s.length for s in members):  # contiguous: a view
        q = query[:, :, first.start:last.start + last.length]
    else:
        q = torch.cat([query[:, :, s.start:s.start + s.length] for s in members], dim=2)
    prefix_out, prefix_lse = _flash(q, keys, values, 0.0, False, scale=scaling)
    own = [_own_part(query[:, :, s.start:s.start + s.length], view, s, shared_pages * S, scaling) for s in members]
    own_out = torch.cat([o for o, _ in own], dim=2) if len(own) > 1 else own[0][0]
    own_lse = torch.cat([lse for _, lse in own], dim=2) if len(own) > 1 else own[0][1]
    weight = torch.sigmoid(prefix_lse - own_lse).unsqueeze(-1)
    merged = own_out.float() + (prefix_out.float() - own_out.float()) * weight  # [1, Hq, sum L, Dv]
    merged = merged.to(query.dtype).transpose(1, 2)
    return list(merged.split([s.length for s in members], dim=1))
