"""Float64 reference for paged attention (the test oracle).

This module is deliberately slow and plain: it walks the page table row by row,
gathers the kept pages of a row into a contiguous list of tokens, and does the
attention of every head in float64 with explicit masks.  It has no dependency
on triton and is the definition of the semantics that
:func:`hf_paged.kernels.triton_paged_attention.paged_attention_triton` must match.

Layout (shared with the Triton kernel)
--------------------------------------
* ``query``      ``[B, Hq, Q, D]`` (any strides).
* ``k_pool``/``v_pool`` ``[P, S, Hkv, D]``: ``P`` pages of ``S`` token slots.
* ``page_table`` ``[B, N]`` int: entry ``n`` of row ``b`` is a physical page id,
  or ``-1`` for "no page" (the entry is skipped).  Entries need not be sorted or
  consecutive.
* ``page_pos``   ``[B, N]`` int: logical position of slot 0 of that page; slot
  ``s`` holds the token at position ``page_pos + s``.  Ignored for ``-1`` entries.
* ``q_pos``      ``[B, Q]`` int64: logical position of every query token.
* ``kv_format``  a page format of :mod:`hf_paged.kv_formats`: ``"float"`` (the default), or quantized pools
  (codes) with their float16 ``k_scale``/``v_scale``, which are dequantized first (into the model's basis).
* ``cold``       a two-tier layer (`hf_paged.kernels.arguments.ColdTier`): the pools are its hot float pages, the
  table's ids are page ids, each read from the row its tier's map names (cold pages dequantized first); an id
  without a row in either tier is a hole.

Query ``i`` of row ``b``, head ``h``, attends the token at position ``p`` held
in a valid page iff all of the following hold:

* causality: ``p <= q_pos[b, i]``;
* ``sliding_window`` (if set): ``q_pos[b, i] - p < sliding_window``;
* ``mask`` (if set): ``mask_offset <= p < mask_offset + M`` and
  ``mask[b, h or 0, i, p - mask_offset]`` is True.

Scores are ``scale * q.k``, then ``softcap * tanh(score / softcap)`` if
``softcap`` is set.  The softmax denominator includes ``exp(s_aux[h])`` when
``s_aux`` is given (an attention sink without a value).  A query that attends
no token gets an all-zero output.  Query head ``h`` reads KV head
``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import torch

from ..kv_formats import dequantize, page_format
from .arguments import ColdTier

__all__ = ["paged_attention_reference", "LEAVE_OUT_FLOOR"]

LEAVE_OUT_FLOOR = 1e-6  # 1 - A below this (one entry holding all the attention) counts as this


def paged_attention_reference(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    page_pos: torch.Tensor,
    q_pos: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    mask_offset: int = 0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    return_page_mass: bool = False,
    page_mass_signal: str = "attention",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_format: str = "float",
    cold: ColdTier | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged attention computed in float64 with explicit loops and gathers (quantized pools dequantized first).

    Returns ``out [B, Q, Hq, D]`` in ``query.dtype`` and, with
    ``return_page_mass``, also ``page_mass`` float32 ``[B, Hq, N]``: the
    attention probability ``A`` falling on the tokens of each page-table entry,
    averaged over the ``Q`` queries (0 for ``-1`` entries). With
    ``page_mass_signal="output"``, instead how far the head's output ``o`` would
    move if the entry's tokens were dropped: ``‖Σ a·v − A·o‖ / (1 − A)`` (the
    sums over the entry's tokens; ``1 − A`` at least `LEAVE_OUT_FLOOR`), averaged
    over the queries.
    """
    B, Hq, Q, D = query.shape
    fmt = page_format(kv_format)
    if fmt.quantized:
        k_pool = dequantize(fmt.key, k_pool, k_scale, D)
        v_pool = dequantize(fmt.value, v_pool, v_scale, D)
    if cold is not None:
        k_pool, v_pool, page_table = _one_pool(k_pool, v_pool, page_table, cold, D)
    P, S, Hkv, Dk = k_pool.shape
    N = page_table.shape[1]
    if Dk != D or v_pool.shape != k_pool.shape:
        raise ValueError("k_pool/v_pool must both be [P, S, Hkv, D] with D = query.shape[-1]")
    if Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    group = Hq // Hkv
    f64 = torch.float64

    out = torch.zeros(B, Q, Hq, D, dtype=f64, device=query.device)
    page_mass = torch.zeros(B, Hq, N, dtype=f64, device=query.device)

    for b in range(B):
        # 1. Gather the row's kept pages into a flat list of tokens.
        keys, values, positions, entry_of_token = [], [], [], []
        for n in range(N):
            page = int(page_table[b, n])
            if page < 0:
                continue
            start = int(page_pos[b, n])
            keys.append(k_pool[page].to(f64))  # [S, Hkv, D]
            values.append(v_pool[page].to(f64))
            positions.append(torch.arange(start, start + S, dtype=torch.long, device=query.device))
            entry_of_token.append(torch.full((S,), n, dtype=torch.long, device=query.device))
        if not keys:
            continue  # nothing to attend: output stays zero
        K = torch.cat(keys)  # [T, Hkv, D]
        V = torch.cat(values)
        pos = torch.cat(positions)  # [T]
        entry = torch.cat(entry_of_token)  # [T]

        for h in range(Hq):
            kvh = h // group
            q = query[b, h].to(f64)  # [Q, D]

            # 2. Which (query, token) pairs may attend.
            qp = q_pos[b].to(torch.long)[:, None]  # [Q, 1]
            allowed = pos[None, :] <= qp  # [Q, T]
            if sliding_window is not None:
                allowed &= (qp - pos[None, :]) < sliding_window
            if mask is not None:
                m = mask[b if mask.shape[0] > 1 else 0, h if mask.shape[1] > 1 else 0]  # [Q, M]
                M = m.shape[-1]
                idx = pos - mask_offset
                inside = (idx >= 0) & (idx < M)
                looked_up = m[:, idx.clamp(0, max(M - 1, 0))] if M > 0 else torch.zeros_like(allowed)
                allowed &= inside[None, :] & looked_up.to(torch.bool)

            # 3. Scores, softcap, masked softmax with an optional sink logit.
            scores = (q @ K[:, kvh].T) * scale  # [Q, T]
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            scores = torch.where(allowed, scores, torch.full_like(scores, float("-inf")))
            row_max = scores.max(dim=1).values  # [Q], -inf for rows with nothing allowed
            if s_aux is not None:
                sink = s_aux[h].to(f64)
                row_max = torch.maximum(row_max, sink.expand_as(row_max))
            row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
            unnorm = torch.where(allowed, torch.exp(scores - row_max[:, None]), torch.zeros_like(scores))
            denom = unnorm.sum(dim=1)
            if s_aux is not None:
                denom = denom + torch.exp(sink - row_max)
            probs = unnorm / torch.where(denom > 0, denom, torch.ones_like(denom))[:, None]  # [Q, T]

            # 4. Output; values of tokens nobody attends are never touched (they may be garbage).
            v = V[:, kvh]
            v = torch.where(allowed.any(dim=0)[:, None], v, torch.zeros_like(v))
            out[b, :, h] = probs @ v

            # 5. Probability mass per page-table entry (or the output it moves), averaged over the queries.
            if page_mass_signal == "output":
                mass = torch.zeros(Q, N, dtype=f64, device=query.device).index_add_(1, entry, probs)  # [Q, N]
                moved = torch.zeros(Q, N, D, dtype=f64, device=query.device).index_add_(
                    1, entry, probs[:, :, None] * v[None])  # sum of a * v per entry
                moved = (moved - mass[:, :, None] * out[b, :, h][:, None, :]).norm(dim=-1)
                page_mass[b, h] += (moved / (1 - mass).clamp(min=LEAVE_OUT_FLOOR)).sum(dim=0) / max(Q, 1)
                continue
            per_token = probs.sum(dim=0) / Q if Q > 0 else probs.sum(dim=0)
            page_mass[b, h].index_add_(0, entry, per_token)

    out = out.to(query.dtype)
    if return_page_mass:
        return out, page_mass.to(torch.float32)
    return out


def _one_pool(k_pool, v_pool, page_table, cold: ColdTier, D: int):
    """A two-tier layer as one float64 pool indexed by page id, and the table with ids holding nothing as holes."""
    fmt = cold.format
    tiers = ((k_pool, v_pool, cold.hot_row),
             (dequantize(fmt.key, cold.k_pool, cold.k_scale, D), dequantize(fmt.value, cold.v_pool, cold.v_scale, D),
              cold.cold_row))
    keys = torch.zeros(len(cold.hot_row), *k_pool.shape[1:], dtype=torch.float64, device=k_pool.device)
    values = torch.zeros_like(keys)
    for k, v, rows in tiers:
        held = rows >= 0
        keys[held], values[held] = k[rows[held]].double(), v[rows[held]].double()
    held = (cold.hot_row >= 0) | (cold.cold_row >= 0)
    holes = (page_table < 0) | ~held[page_table.clamp(min=0).long()]
    return keys, values, page_table.masked_fill(holes, -1)
