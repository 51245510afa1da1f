"""A packed step's sequence (segment) as keys and values: its tokens from a given position on, and their causal mask.

Invariants: the keys and values of a segment's tokens ``from_token .. past + length`` are what its pages hold, bit
for bit, whether gathered from the pages or (when they are all in this step: ``past == from_token``) read from the
step's own ``step_kv``; ``from_token`` is the first token of a page of the segment's table.
"""

from __future__ import annotations

import torch


def segment_kv(view, segment, from_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[1, Hkv, n, D]`` of ``segment``'s tokens from ``from_token`` to its last (``n`` of them)."""
    if segment.past == from_token and view.step_kv is not None:
        return tuple(t[:, :, segment.start:segment.start + segment.length] for t in view.step_kv)
    total = segment.past + segment.length
    keys, values = view.pages.gather(segment.pages[from_token // view.plan.page_size:].to(view.pages.device))
    return tuple(t.flatten(0, 1)[:total - from_token].transpose(0, 1).unsqueeze(0) for t in (keys, values))


def causal_positions(segment, from_token: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_pos [n], q_pos [length, 1])``: the positions of `segment_kv`'s keys and of the segment's new queries; a
    query sees the keys with ``k_pos <= q_pos``."""
    k_pos = torch.arange(from_token, segment.past + segment.length, device=device)
    return k_pos, k_pos[segment.past - from_token:, None]
