"""Triton paged attention: reads K/V straight from a page pool through a page table.

Semantics are defined by :func:`hf_paged.kernels.reference.paged_attention_reference`
(read its module docstring for the exact masking rules); this module is the fast
implementation of the same function.  Importing it requires triton; the rest of
the package does not.

Layout
------
* ``query``      ``[B, Hq, Q, D]``: any strides (a transposed ``[B, Q, Hq, D]`` view is fine).
* ``k_pool``/``v_pool`` ``[P, S, Hkv, D]``: any strides, e.g. halves of a ``[P, 2, S, Hkv, D]`` pool; or the
  codes of a quantized page format (``kv_format`` "int8", "int4", "int2", "fp8_e4m3" of :mod:`hf_paged.kv_formats`,
  unit last stride) with their float16 ``k_scale``/``v_scale``: each tile is loaded, dequantized in fp32
  (scale, and zero point for int4 / int2 values; a page's minimum and step per channel for their keys) and cast to
  the query's dtype before its dot, as vLLM's ``triton_unified_attention`` does with fp8 caches. Rotated
  formats (int4 / int2 values) get the output rotated back after the kernel (and a rotated key format the query
  rotated before it).
* ``page_table`` ``[B, N]`` int32/int64: physical page id of the row's n-th kept page, ``-1`` = none.
* ``page_pos``   ``[B, N]`` int32/int64: position of slot 0 of that page (slot ``s`` is at ``page_pos + s``).
* ``q_pos``      ``[B, Q]`` int64: position of every query token.
* output ``[B, Q, Hq, D]`` in ``query.dtype`` (what transformers' attention functions return).

Algorithm
---------
The attention kernel is a FlashAttention-style online softmax over the *slots of
the page table*: a row's page-table entries are viewed as one flat axis of
``N * S`` token slots, slot ``t`` lives in entry ``t // S`` at offset ``t % S``.
Each program owns

* one batch row ``b`` and one KV head (GQA/MQA: the ``G = Hq // Hkv`` query heads
  sharing that KV head are packed into the rows of the tile, so K/V are loaded
  once per group and never repeated in memory),
* a block of ``BLOCK_Q`` query tokens; tile rows are ``(query, head-in-group)``
  pairs, ``row = q_local * G + g``, padded to ``BLOCK_M`` (a power of two >= 16),
* one split: a contiguous range of tiles of ``BLOCK_N`` slots.

Per tile it gathers the page ids and page positions for the slots, derives each
slot's logical position, builds the ``[BLOCK_M, BLOCK_N]`` "may attend"
predicate (page exists, causality, sliding window, 4D mask), loads K/V of only
the slots somebody may attend (other slots may hold garbage, even NaN), and
updates the running ``(max, sum, acc)`` in fp32.

Split-K: when ``B * Hkv * q_blocks`` programs cannot fill the GPU (decode with a
small batch and a long context), the slot range of a row is cut into
``num_splits`` parts, each program writes its unnormalised partial
``(m, l, acc)`` to fp32 scratch, and ``_combine_splits_kernel`` merges them.
With one split the attention kernel normalises and writes the output itself.

The attention sink ``s_aux`` (one logit per query head, no value) only enters the
final normalisation: ``M = max(m, s), l = l * e^(m-M) + e^(s-M), out = acc * e^(m-M) / l``.
Rows with nothing to attend have ``l == 0`` (no sink) or ``acc == 0`` (sink)
and give zeros.

Page mass (optional) needs the final normaliser, so it is a second, separate
pass (``_page_mass_kernel``): one program per ``(row, query head, page entry)``
recomputes the scores of that page's tokens against all queries and sums
``exp(score - lse)``; it re-reads K (not V) once per query head.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..kv_formats import PageFormat, rotation, slot_scale_strides
from .arguments import ColdTier, check_paged_args, mask_strides

__all__ = ["paged_attention_triton"]

# Smallest number of token slots worth giving to one split, and the most splits.
_MIN_SLOTS_PER_SPLIT = 256
_MAX_SPLITS = 64


# --------------------------------------------------------------------------- #
# Device helpers (inlined into the kernels).
# --------------------------------------------------------------------------- #
@triton.jit
def _tanh(x):
    """tanh(x) from exp(-2|x|), which never overflows."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _packed_code(Pool, base, d, ok, TWO_BITS: tl.constexpr):
    """int32 codes of elements ``d`` of packed rows starting at ``base``: two 4-bit codes a byte (element d in the
    low nibble when even), or four 2-bit codes (element d at bits 2 (d % 4)); 0 where not ``ok``."""
    if TWO_BITS:
        byte = tl.load(Pool + base + d // 4, mask=ok, other=0).to(tl.int32)
        return (byte >> ((d % 4) * 2)) & 3
    byte = tl.load(Pool + base + d // 2, mask=ok, other=0).to(tl.int32)
    return (byte >> ((d % 2) * 4)) & 15


@triton.jit
def _load_rows(Pool, Scale, base, scale_base, d, ok, stride_d,
               FORMAT: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Elements ``d`` of the K or V rows starting at element offsets ``base`` (their scales at ``scale_base``),
    all broadcast together; 0 where not ``ok``. FORMAT: 0 float (the pool's dtype, strides ``stride_d``), else
    fp32 dequantized (`_format_code`): 1 int8 ``scale * code``, 2 int4 ``scale * (code - zero)``, 3 fp8
    ``scale * code``, 4 int4 keys ``low + step * code`` (``Scale`` holds the page's D float16 minima, then its D
    float8 steps as bytes); 5 and 6: int2's, as 2 and 4 (`_packed_code`)."""
    if FORMAT == 0:
        return tl.load(Pool + base + d * stride_d, mask=ok, other=0.0)
    if FORMAT == 4 or FORMAT == 6:
        code = _packed_code(Pool, base, d, ok, FORMAT == 6)
        low = tl.load(Scale + scale_base + d, mask=ok, other=0.0).to(tl.float32)
        pair = tl.load(Scale + scale_base + HEAD_DIM + d // 2, mask=ok, other=0.0)
        bits = (pair.to(tl.int16, bitcast=True).to(tl.int32) >> ((d % 2) * 8)) & 255  # float8 e4m3, never negative
        exponent, mantissa = (bits >> 3) & 15, (bits & 7).to(tl.float32)
        step = tl.where(exponent > 0, (1.0 + mantissa * 0.125) * tl.exp2((exponent - 7).to(tl.float32)),
                        mantissa * 0.001953125)
        return code.to(tl.float32) * step + low
    group = d // GROUP
    scale = tl.load(Scale + scale_base + group, mask=ok, other=0.0).to(tl.float32)
    if FORMAT == 2 or FORMAT == 5:
        code = _packed_code(Pool, base, d, ok, FORMAT == 5)
        zero = tl.load(Pool + base + HEAD_DIM // (4 if FORMAT == 5 else 2) + group, mask=ok, other=0).to(tl.int32)
        zero = tl.where(zero >= 128, zero - 256, zero)  # the int8 stored in a uint8 pool
        return (code - zero).to(tl.float32) * scale
    if FORMAT == 3:
        return tl.load(Pool + base + d, mask=ok, other=0.0).to(tl.float32) * scale
    return tl.load(Pool + base + d, mask=ok, other=0).to(tl.float32) * scale


@triton.jit
def _may_attend(
    pos,  # [BLOCK_N] int64 logical position of each slot
    slot_ok,  # [BLOCK_N] bool: slot is inside the range and its page exists
    q_pos,  # [BLOCK_M] int64 position of each row's query
    row_ok,  # [BLOCK_M] bool
    head,  # [BLOCK_M] query head of each row
    q_idx,  # [BLOCK_M] query index of each row
    b,
    Mask,
    stride_mb,
    stride_mh,
    stride_mq,
    stride_mk,
    mask_offset,
    mask_len,
    sliding_window,
    HAS_MASK: tl.constexpr,
    HAS_SLIDING: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] predicate: query row may attend slot (see reference docstring)."""
    ok = row_ok[:, None] & slot_ok[None, :] & (pos[None, :] <= q_pos[:, None])
    if HAS_SLIDING:
        ok = ok & ((q_pos[:, None] - pos[None, :]) < sliding_window)
    if HAS_MASK:
        mi = pos - mask_offset
        ok = ok & ((mi >= 0) & (mi < mask_len))[None, :]
        m_ptr = (
            Mask
            + b.to(tl.int64) * stride_mb
            + head[:, None].to(tl.int64) * stride_mh
            + q_idx[:, None].to(tl.int64) * stride_mq
            + mi[None, :] * stride_mk
        )
        ok = ok & (tl.load(m_ptr, mask=ok, other=0) != 0)
    return ok


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    """fp32-accumulated a @ b; IEEE fp32 products for fp32 inputs (no TF32).

    The Triton interpreter multiplies bf16 blocks as their raw uint16 bits, so
    there the (already bf16-rounded) operands are widened to fp32 first; on a GPU
    the dot runs on the bf16/fp16 tensor cores.
    """
    if INTERPRET:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
        if b.dtype == tl.bfloat16:
            b = b.to(tl.float32)
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def _scores(q, k, scale, softcap, HAS_SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 scores scale * q @ k (k is [D, N]), optionally soft-capped."""
    s = _dot(q, k.to(q.dtype), INTERPRET) * scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    return s


@triton.jit
def _finalize(m, l, acc, sink, HAS_SINK: tl.constexpr):
    """Normalise a (max [R], sum [R], acc [R, D]) triple; returns (out, lse).

    Rows without any attended token (l == 0) give out = 0 and lse = -inf
    (or lse = sink with an attention sink).
    """
    if HAS_SINK:
        m_tot = tl.maximum(m, sink)  # finite: the sink is a finite logit
        w = tl.exp(m - m_tot)  # 0 where m == -inf
        l = l * w + tl.exp(sink - m_tot)
        acc = acc * w[:, None]
        m = m_tot
    has_mass = l > 0
    safe_l = tl.where(has_mass, l, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(has_mass, m + tl.log(safe_l), float("-inf"))
    return out, lse


@triton.jit
def _rotation_tile(Rot, offs_d, d_ok, HEAD_DIM: tl.constexpr):
    """The [BLOCK_D, BLOCK_D] float32 rotation of rotated formats (``kv_formats.rotation``), zero-padded."""
    return tl.load(Rot + offs_d[:, None] * HEAD_DIM + offs_d[None, :], mask=d_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _attend_tiles(
    q, m_i, l_i, acc, K, V, KScale, VScale, Rows, PageTable, PagePos, Mask, b, kv_head, q_pos, row_ok, head, q_idx,
    offs_d, d_ok, slot_begin, slot_end, scale, softcap, sliding_window, mask_offset, mask_len,
    stride_kp, stride_ks, stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd,
    stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
    stride_ptb, stride_ptn, stride_ppb, stride_ppn, stride_mb, stride_mh, stride_mq, stride_mk,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, FORMAT: tl.constexpr, KEY_FORMAT: tl.constexpr,
    K_GROUP: tl.constexpr, V_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROWS: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_SLIDING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Fold the slots [slot_begin, slot_end) held in the pools K/V (format FORMAT) into the running (max, sum,
    acc); with HAS_ROWS the table holds page ids and ``Rows[id]`` is the id's row of these pools (-1: in the other
    tier, skipped like a hole). Returns the new (m_i, l_i, acc)."""
    for start in range(slot_begin, slot_end, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        in_range = t < slot_end
        entry = t // PAGE_SIZE
        offset = t % PAGE_SIZE
        page = tl.load(PageTable + b * stride_ptb + entry * stride_ptn, mask=in_range, other=-1).to(tl.int64)
        if HAS_ROWS:
            page = tl.load(Rows + page, mask=page >= 0, other=-1)
        first = tl.load(PagePos + b * stride_ppb + entry * stride_ppn, mask=in_range, other=0).to(tl.int64)
        pos = first + offset
        ok = _may_attend(pos, in_range & (page >= 0), q_pos, row_ok, head, q_idx, b,
                         Mask, stride_mb, stride_mh, stride_mq, stride_mk,
                         mask_offset, mask_len, sliding_window, HAS_MASK, HAS_SLIDING)
        # Only slots that some row attends are read: the rest may be garbage.
        col_ok = tl.max(ok.to(tl.int32), axis=0) > 0

        k = _load_rows(K, KScale, page[None, :] * stride_kp + offset[None, :] * stride_ks + kv_head * stride_kh,
                       page[None, :] * stride_ksp + offset[None, :] * stride_kss + kv_head * stride_ksh,
                       offs_d[:, None], col_ok[None, :] & d_ok[:, None], stride_kd,
                       KEY_FORMAT, K_GROUP, HEAD_DIM)  # [BLOCK_D, BLOCK_N]
        s = _scores(q, k, scale, softcap, HAS_SOFTCAP, INTERPRET)
        s = tl.where(ok, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoid (-inf) - (-inf)
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = _load_rows(V, VScale, page[:, None] * stride_vp + offset[:, None] * stride_vs + kv_head * stride_vh,
                       page[:, None] * stride_vsp + offset[:, None] * stride_vss + kv_head * stride_vsh,
                       offs_d[None, :], col_ok[:, None] & d_ok[None, :], stride_vd,
                       FORMAT, V_GROUP, HEAD_DIM)  # [BLOCK_N, BLOCK_D]
        if FORMAT != 0:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, INTERPRET)
        m_i = m_new

    return m_i, l_i, acc


# --------------------------------------------------------------------------- #
# Kernel 1: attention over (a split of) the page-table slots.
# --------------------------------------------------------------------------- #
@triton.jit
def _paged_attention_kernel(
    Q, K, V, KScale, VScale, PageTable, PagePos, QPos, Mask, Sink,
    Out, Lse, MidM, MidL, MidAcc,
    HotRow, ColdRow, CK, CV, CKScale, CVScale, Rot,  # two tiers (`ColdTier`; dummies otherwise)
    scale, softcap, sliding_window, mask_offset, mask_len,
    num_q, num_kv_heads, num_entries,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_ksp, stride_kss, stride_ksh,  # KScale / VScale (unit last stride)
    stride_vsp, stride_vss, stride_vsh,
    stride_ptb, stride_ptn,
    stride_ppb, stride_ppn,
    stride_qpb, stride_qpq,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_ob, stride_oq, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lq,
    stride_xb, stride_xh, stride_xq, stride_xs, stride_xd,  # MidAcc; MidM/MidL have the first four
    stride_ckp, stride_cks, stride_ckh, stride_cvp, stride_cvs, stride_cvh,  # CK / CV (unit last stride)
    stride_cksp, stride_ckss, stride_cksh, stride_cvsp, stride_cvss, stride_cvsh,  # CKScale / CVScale
    GROUP: tl.constexpr,  # query heads per KV head
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FORMAT: tl.constexpr,  # 0 float, 1 int8, 2 int4, 3 fp8, 5 int2 (`_load_rows`, `_format_code`)
    KEY_FORMAT: tl.constexpr,  # FORMAT, or 4 (6): int4 (int2) keys per channel within a page
    K_GROUP: tl.constexpr,  # elements per scale group of quantized keys / values
    V_GROUP: tl.constexpr,
    TWO_TIERS: tl.constexpr,  # K/V are the hot pools, CK/CV the cold ones; table ids map through HotRow/ColdRow
    COLD_FORMAT: tl.constexpr,  # FORMAT, KEY_FORMAT, groups and rotations of the cold pools
    COLD_KEY_FORMAT: tl.constexpr,
    COLD_K_GROUP: tl.constexpr,
    COLD_V_GROUP: tl.constexpr,
    COLD_K_ROTATED: tl.constexpr,
    COLD_V_ROTATED: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # tile rows >= BLOCK_Q * GROUP, power of two >= 16
    BLOCK_N: tl.constexpr,  # slots per tile
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    HAS_MASK: tl.constexpr,
    HAS_SLIDING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINK: tl.constexpr,
    SPLIT: tl.constexpr,  # True: write partials to Mid*; False: write Out (and Lse)
    STORE_LSE: tl.constexpr,
    INTERPRET: tl.constexpr,  # running under TRITON_INTERPRET=1
):
    """Grid: (B * Hkv * q_blocks, num_splits). See the module docstring."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    q_blocks = tl.cdiv(num_q, BLOCK_Q)
    q_block = pid % q_blocks
    kv_head = (pid // q_blocks) % num_kv_heads
    b = pid // (q_blocks * num_kv_heads)

    # Tile rows: (query token, head in group) pairs.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < num_q)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptr = (Q + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh
             + q_idx[:, None] * stride_qq + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.load(QPos + b * stride_qpb + q_idx * stride_qpq, mask=row_ok, other=-1).to(tl.int64)

    # This split's share of the row's slots [0, N * S), in whole tiles.
    num_slots = num_entries * PAGE_SIZE
    tiles_per_split = tl.cdiv(tl.cdiv(num_slots, BLOCK_N), num_splits)
    slot_begin = split * tiles_per_split * BLOCK_N
    slot_end = tl.minimum(slot_begin + tiles_per_split * BLOCK_N, num_slots)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_tiles(
        q, m_i, l_i, acc, K, V, KScale, VScale, HotRow, PageTable, PagePos, Mask, b, kv_head, q_pos, row_ok, head,
        q_idx, offs_d, d_ok, slot_begin, slot_end, scale, softcap, sliding_window, mask_offset, mask_len,
        stride_kp, stride_ks, stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd,
        stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
        stride_ptb, stride_ptn, stride_ppb, stride_ppn, stride_mb, stride_mh, stride_mq, stride_mk,
        PAGE_SIZE, HEAD_DIM, FORMAT, KEY_FORMAT, K_GROUP, V_GROUP, BLOCK_N, TWO_TIERS,
        HAS_MASK, HAS_SLIDING, HAS_SOFTCAP, INTERPRET)
    if TWO_TIERS:  # then the cold pages, in their basis: q.k = (q R).(k R), sum p v R = (sum p v) R
        if COLD_K_ROTATED:
            q = _dot(q.to(tl.float32), _rotation_tile(Rot, offs_d, d_ok, HEAD_DIM), INTERPRET).to(q.dtype)
        if COLD_V_ROTATED:
            acc = _dot(acc, _rotation_tile(Rot, offs_d, d_ok, HEAD_DIM), INTERPRET)
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, CK, CV, CKScale, CVScale, ColdRow, PageTable, PagePos, Mask, b, kv_head, q_pos, row_ok,
            head, q_idx, offs_d, d_ok, slot_begin, slot_end, scale, softcap, sliding_window, mask_offset, mask_len,
            stride_ckp, stride_cks, stride_ckh, 1, stride_cvp, stride_cvs, stride_cvh, 1,
            stride_cksp, stride_ckss, stride_cksh, stride_cvsp, stride_cvss, stride_cvsh,
            stride_ptb, stride_ptn, stride_ppb, stride_ppn, stride_mb, stride_mh, stride_mq, stride_mk,
            PAGE_SIZE, HEAD_DIM, COLD_FORMAT, COLD_KEY_FORMAT, COLD_K_GROUP, COLD_V_GROUP, BLOCK_N, True,
            HAS_MASK, HAS_SLIDING, HAS_SOFTCAP, INTERPRET)

    if SPLIT:
        x_off = (b.to(tl.int64) * stride_xb + head * stride_xh + q_idx * stride_xq + split * stride_xs)
        tl.store(MidM + x_off, m_i, mask=row_ok)
        tl.store(MidL + x_off, l_i, mask=row_ok)
        tl.store(MidAcc + x_off[:, None] + offs_d[None, :] * stride_xd, acc,
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        sink = tl.zeros([BLOCK_M], tl.float32)
        if HAS_SINK:
            sink = tl.load(Sink + head, mask=row_ok, other=0.0).to(tl.float32)
        out, lse = _finalize(m_i, l_i, acc, sink, HAS_SINK)
        o_ptr = (Out + b.to(tl.int64) * stride_ob + q_idx[:, None] * stride_oq
                 + head[:, None] * stride_oh + offs_d[None, :] * stride_od)
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if STORE_LSE:
            tl.store(Lse + b * stride_lb + head * stride_lh + q_idx * stride_lq, lse, mask=row_ok)


# --------------------------------------------------------------------------- #
# Kernel 2: merge the split partials of one (row, head, query).
# --------------------------------------------------------------------------- #
@triton.jit
def _combine_splits_kernel(
    MidM, MidL, MidAcc, Sink, Out, Lse,
    num_heads, num_q, num_splits,
    stride_xb, stride_xh, stride_xq, stride_xs, stride_xd,
    stride_ob, stride_oq, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lq,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits
    BLOCK_D: tl.constexpr,
    HAS_SINK: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    """Grid: (B * Hq * Q,). out = sum_j e^(m_j - M) acc_j / (sum_j e^(m_j - M) l_j [+ sink])."""
    pid = tl.program_id(0)
    q_idx = pid % num_q
    head = (pid // num_q) % num_heads
    b = pid // (num_q * num_heads)

    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    base = b.to(tl.int64) * stride_xb + head * stride_xh + q_idx * stride_xq
    m = tl.load(MidM + base + offs_s * stride_xs, mask=s_ok, other=float("-inf"))
    l = tl.load(MidL + base + offs_s * stride_xs, mask=s_ok, other=0.0)
    acc = tl.load(MidAcc + base + offs_s[:, None] * stride_xs + offs_d[None, :] * stride_xd,
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)

    # Keep a leading axis of length 1 so _finalize sees the same shapes as in kernel 1.
    m_max = tl.max(m, axis=0, keep_dims=True)  # [1]
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_ref)  # [BLOCK_S], 0 for empty splits
    l_tot = tl.sum(l * w, axis=0, keep_dims=True)  # [1]
    acc_tot = tl.sum(acc * w[:, None], axis=0, keep_dims=True)  # [1, BLOCK_D]
    sink = tl.zeros([1], tl.float32)
    if HAS_SINK:
        sink = tl.load(Sink + head + tl.zeros([1], tl.int32)).to(tl.float32)
    out, lse = _finalize(m_max, l_tot, acc_tot, sink, HAS_SINK)

    o_ptr = Out + b.to(tl.int64) * stride_ob + q_idx * stride_oq + head * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=d_ok[None, :])
    if STORE_LSE:
        tl.store(Lse + b * stride_lb + head * stride_lh + q_idx * stride_lq + tl.arange(0, 1), lse)


# --------------------------------------------------------------------------- #
# Kernel 3 (optional): attention probability mass per page-table entry.
# --------------------------------------------------------------------------- #
@triton.jit
def _page_mass_kernel(
    Q, K, KScale, PageTable, PagePos, QPos, Mask, Lse, Mass,
    HotRow, ColdRow, CK, CKScale, Rot,  # two tiers (dummies otherwise)
    scale, softcap, sliding_window, mask_offset, mask_len,
    num_q, num_heads, num_entries,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_ksp, stride_kss, stride_ksh,
    stride_ptb, stride_ptn,
    stride_ppb, stride_ppn,
    stride_qpb, stride_qpq,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_lb, stride_lh, stride_lq,
    stride_ab, stride_ah, stride_an,
    stride_ckp, stride_cks, stride_ckh, stride_cksp, stride_ckss, stride_cksh,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FORMAT: tl.constexpr,
    KEY_FORMAT: tl.constexpr,
    K_GROUP: tl.constexpr,
    TWO_TIERS: tl.constexpr,
    COLD_KEY_FORMAT: tl.constexpr,
    COLD_K_GROUP: tl.constexpr,
    COLD_K_ROTATED: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # power of two >= 16
    BLOCK_N: tl.constexpr,  # power of two >= 16
    BLOCK_D: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SLIDING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Grid: (B * Hq * N,). Mass[b, h, n] = mean_i sum_{s in page n} exp(score[i, s] - lse[i]).

    Uses the final log-sum-exp ``Lse`` [B, Hq, Q] of kernel 1/2 (which includes
    the sink), so the probabilities are exactly those used for the output.
    Every element of Mass is written (0 for ``-1`` entries).
    """
    pid = tl.program_id(0)
    entry = pid % num_entries
    head = (pid // num_entries) % num_heads
    b = pid // (num_entries * num_heads)
    kv_head = head // GROUP

    # The entry's page id and first position, broadcast over the BLOCK_N slots of a tile.
    same = tl.zeros([BLOCK_N], tl.int32)
    page = tl.load(PageTable + b * stride_ptb + entry * stride_ptn + same).to(tl.int64)
    first = tl.load(PagePos + b * stride_ppb + entry * stride_ppn + same).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    cold_page = page  # two tiers: the entry's row in either tier (-1 in the other one)
    if TWO_TIERS:
        cold_page = tl.load(ColdRow + page, mask=page >= 0, other=-1)
        page = tl.load(HotRow + page, mask=page >= 0, other=-1)
    heads = head + tl.zeros([BLOCK_Q], tl.int32)

    total = tl.zeros([BLOCK_Q], tl.float32)
    for s0 in range(0, PAGE_SIZE, BLOCK_N):
        offset = s0 + tl.arange(0, BLOCK_N)
        slot_ok = (offset < PAGE_SIZE) & ((page >= 0) | (cold_page >= 0))
        pos = first + offset
        for q0 in range(0, num_q, BLOCK_Q):
            q_idx = q0 + tl.arange(0, BLOCK_Q)
            q_ok = q_idx < num_q
            q_pos = tl.load(QPos + b * stride_qpb + q_idx * stride_qpq, mask=q_ok, other=-1).to(tl.int64)
            lse = tl.load(Lse + b * stride_lb + head * stride_lh + q_idx * stride_lq, mask=q_ok,
                          other=float("-inf"))
            row_ok = q_ok & (lse > float("-inf"))
            ok = _may_attend(pos, slot_ok, q_pos, row_ok, heads, q_idx, b,
                             Mask, stride_mb, stride_mh, stride_mq, stride_mk,
                             mask_offset, mask_len, sliding_window, HAS_MASK, HAS_SLIDING)
            col_ok = tl.max(ok.to(tl.int32), axis=0) > 0
            q = tl.load(Q + b.to(tl.int64) * stride_qb + head * stride_qh + q_idx[:, None] * stride_qq
                        + offs_d[None, :] * stride_qd, mask=q_ok[:, None] & d_ok[None, :], other=0.0)
            k = _load_rows(K, KScale, page[None, :] * stride_kp + offset[None, :] * stride_ks + kv_head * stride_kh,
                           page[None, :] * stride_ksp + offset[None, :] * stride_kss + kv_head * stride_ksh,
                           offs_d[:, None], (col_ok & (page >= 0))[None, :] & d_ok[:, None], stride_kd, KEY_FORMAT,
                           K_GROUP, HEAD_DIM)
            s = _scores(q, k, scale, softcap, HAS_SOFTCAP, INTERPRET)
            if TWO_TIERS:  # the entry's page is in one tier: the other tier's load read nothing
                cold_ok = col_ok & (cold_page >= 0)
                k = _load_rows(CK, CKScale, cold_page[None, :] * stride_ckp + offset[None, :] * stride_cks
                               + kv_head * stride_ckh, cold_page[None, :] * stride_cksp + offset[None, :] * stride_ckss
                               + kv_head * stride_cksh, offs_d[:, None], cold_ok[None, :] & d_ok[:, None], 1,
                               COLD_KEY_FORMAT, COLD_K_GROUP, HEAD_DIM)
                if COLD_K_ROTATED:
                    q = _dot(q.to(tl.float32), _rotation_tile(Rot, offs_d, d_ok, HEAD_DIM), INTERPRET).to(q.dtype)
                s = tl.where((cold_page >= 0)[None, :], _scores(q, k, scale, softcap, HAS_SOFTCAP, INTERPRET), s)
            lse_ref = tl.where(row_ok, lse, 0.0)
            p = tl.where(ok, tl.exp(s - lse_ref[:, None]), 0.0)
            total += tl.sum(p, axis=1)
    mass = tl.sum(total, axis=0) / num_q
    tl.store(Mass + b * stride_ab + head * stride_ah + entry * stride_an, mass)


# --------------------------------------------------------------------------- #
# Python wrapper.
# --------------------------------------------------------------------------- #
@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _choose_num_splits(num_programs: int, num_slots: int, device: torch.device) -> int:
    """Splits per row so that ~2 programs per SM exist, without splits under 256 slots.

    ``num_programs`` is the grid size without splitting (B * Hkv * q_blocks);
    ``num_slots`` the length of a row's slot axis (N * S), a bound on the context.
    """
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    target = 2 * sms
    if num_programs >= target:
        return 1
    by_length = num_slots // _MIN_SLOTS_PER_SPLIT
    return max(1, min(triton.cdiv(target, max(num_programs, 1)), by_length, _MAX_SPLITS))


def _tile_sizes(num_q: int, group: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N, BLOCK_D) for the attention kernel."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    rows_target = 16 if num_q == 1 else (64 if block_d <= 128 else 32)
    block_q = max(1, min(num_q, rows_target // group))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    block_n = 64 if block_d <= 64 else (32 if block_d <= 128 else 16)
    return block_q, block_m, block_n, block_d


_FORMAT_CODES = {"float": 0, "int8": 1, "int4": 2, "fp8_e4m3": 3, "int2": 5}  # per token (`_load_rows`)


def _format_code(fmt: PageFormat, codec) -> int:
    """`_load_rows`'s FORMAT of the keys' or values' ``codec`` of ``fmt``: per channel within a page (4 int4, 6
    int2), else the format's per-token code."""
    if getattr(codec, "per_page", False):
        return 4 if codec.bits == 4 else 6
    return _FORMAT_CODES[fmt.name]


def _tier_arguments(cold: ColdTier | None, D: int, page_table, k_pool, k_scale_arg, q_pos) -> tuple:
    """The attention kernel's two-tier arguments: (HotRow, ColdRow, CK, CV, CKScale, CVScale, Rot), the cold pools'
    strides (CK, CV, CKScale, CVScale; three each) and the COLD_* flags; dummies without ``cold``."""
    if cold is None:
        pointers = (page_table, page_table, k_pool, k_pool, k_scale_arg, k_scale_arg, q_pos)
        flags = dict(TWO_TIERS=False, COLD_FORMAT=0, COLD_KEY_FORMAT=0, COLD_K_GROUP=1, COLD_V_GROUP=1,
                     COLD_K_ROTATED=False, COLD_V_ROTATED=False)
        return pointers, (0,) * 12, flags
    fmt, device = cold.format, cold.k_pool.device
    rotated = fmt.key.rotated or fmt.value.rotated
    pointers = (cold.hot_row, cold.cold_row, cold.k_pool, cold.v_pool, cold.k_scale, cold.v_scale,
                rotation(D, device).contiguous() if rotated else q_pos)
    strides = (*cold.k_pool.stride()[:3], *cold.v_pool.stride()[:3], *slot_scale_strides(fmt.key, cold.k_scale),
               *slot_scale_strides(fmt.value, cold.v_scale))
    flags = dict(TWO_TIERS=True, COLD_FORMAT=_format_code(fmt, fmt.value),
                 COLD_KEY_FORMAT=_format_code(fmt, fmt.key),
                 COLD_K_GROUP=fmt.key.group_size(D), COLD_V_GROUP=fmt.value.group_size(D),
                 COLD_K_ROTATED=fmt.key.rotated, COLD_V_ROTATED=fmt.value.rotated)
    return pointers, strides, flags


def paged_attention_triton(
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
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_format: str = "float",
    cold: ColdTier | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged attention over K/V read in place from ``k_pool``/``v_pool`` via ``page_table``.

    Same semantics as :func:`hf_paged.kernels.reference.paged_attention_reference`:

    Args:
        query: ``[B, Hq, Q, D]``, fp32/fp16/bf16, any strides.
        k_pool, v_pool: ``[P, S, Hkv, D]`` with ``Hq % Hkv == 0``; any page size ``S >= 1``.
        page_table: int ``[B, N]`` physical page ids, ``-1`` = skip the entry.
        page_pos: int ``[B, N]`` position of the first slot of each page.
        q_pos: int ``[B, Q]`` position of each query token (causality: ``p <= q_pos``).
        scale: softmax scale applied to ``q.k``.
        mask: optional bool ``[B or 1, 1 or Hq, Q, M]``; position ``p`` is visible iff
            ``mask[..., p - mask_offset]`` (out-of-range positions are masked).
        sliding_window: attend only if ``q_pos - p < sliding_window``.
        softcap: ``score = softcap * tanh(score / softcap)`` before masking.
        s_aux: optional ``[Hq]`` sink logits (extra softmax term without a value).
        return_page_mass: also return float32 ``[B, Hq, N]`` attention mass per entry,
            averaged over the queries.
        out: optional ``[B, Q, Hq, D]`` output buffer of ``query.dtype`` (any strides).
        num_splits: force the number of split-K parts per row (default: chosen
            from the context length and the GPU size).
        k_scale, v_scale, kv_format: the scales and the page format of quantized pools
            (:mod:`hf_paged.kv_formats`: "int8", "int4", "int2", "fp8_e4m3"); none for "float".
        cold: a two-tier layer's cold pages (`ColdTier`, int8 / int4 / int2): the pools are its hot float pages, the
            table's ids page ids. Each program reads its slots' hot pages, then (the query and its running sum
            rotated into the cold basis in the kernel, for rotated cold formats) its cold pages.

    Returns:
        ``out [B, Q, Hq, D]`` (``query.dtype``), and ``page_mass`` if requested.
        Every output element is written; a query with nothing to attend gets zeros.
    """
    B, Hq, Q, D = query.shape
    S, Hkv = k_pool.shape[1:3]
    N = page_table.shape[1]
    device = query.device
    fmt = check_paged_args(query, k_pool, v_pool, page_table, page_pos, q_pos, mask, s_aux, k_scale, v_scale,
                           kv_format, cold)
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"unsupported query dtype {query.dtype}")
    interpret = bool(triton.knobs.runtime.interpret)
    if device.type != "cuda" and not interpret:
        raise RuntimeError("paged_attention_triton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU)")
    group = Hq // Hkv

    if out is None:
        out = torch.empty(B, Q, Hq, D, dtype=query.dtype, device=device)
    elif tuple(out.shape) != (B, Q, Hq, D) or out.dtype != query.dtype or out.device != device:
        raise ValueError(f"out must be [B, Q, Hq, D] = {(B, Q, Hq, D)} of {query.dtype} on {device}")
    page_mass = torch.zeros(B, Hq, N, dtype=torch.float32, device=device) if return_page_mass else None
    if out.numel() == 0:
        return (out, page_mass) if return_page_mass else out
    result = out
    if fmt.quantized and fmt.key.rotated:  # keys are stored rotated: q.k = (q R).(k R)
        query = (query.float() @ rotation(D, device)).to(query.dtype)
    if (fmt.quantized and fmt.value.rotated) or (cold is not None and cold.format.value.rotated):
        out = torch.empty(B, Q, Hq, D, dtype=torch.float32, device=device)  # rotated: written aside, rotated back
    if fmt.quantized:
        k_scale_arg, v_scale_arg = k_scale, v_scale
        ks, vs = slot_scale_strides(fmt.key, k_scale), slot_scale_strides(fmt.value, v_scale)
        groups = dict(K_GROUP=fmt.key.group_size(D), V_GROUP=fmt.value.group_size(D))
    else:
        k_scale_arg, v_scale_arg, ks, vs, groups = k_pool, v_pool, (0, 0, 0), (0, 0, 0), dict(K_GROUP=1, V_GROUP=1)

    if mask is not None:
        mask_arg, mask_len, sm = mask.view(torch.uint8), mask.shape[3], mask_strides(mask)
    else:
        mask_arg, mask_len, sm = q_pos, 0, [0, 0, 0, 0]  # dummy pointer, never read
    if s_aux is not None:
        sink_arg = s_aux.contiguous()
    else:
        sink_arg = q_pos  # dummy

    block_q, block_m, block_n, block_d = _tile_sizes(Q, group, D)
    q_blocks = triton.cdiv(Q, block_q)
    num_programs = B * Hkv * q_blocks
    if num_splits is None:
        num_splits = _choose_num_splits(num_programs, N * S, device)
    num_splits = max(1, int(num_splits))
    split = num_splits > 1
    store_lse = return_page_mass
    lse = torch.empty(B, Hq, Q, dtype=torch.float32, device=device) if store_lse else out  # dummy if unused
    if split:
        # One fp32 scratch [B, Hq, Q, splits, D + 2]: acc | m | l, so all three share strides.
        mid = torch.empty(B, Hq, Q, num_splits, D + 2, dtype=torch.float32, device=device)
        mid_acc, mid_m, mid_l = mid[..., :D], mid[..., D], mid[..., D + 1]
    else:
        mid_m = mid_l = mid_acc = out  # dummies, never touched
    xs = mid_acc.stride() if split else (0, 0, 0, 0, 0)
    ls = lse.stride() if store_lse else (0, 0, 0)

    flags = dict(
        FORMAT=_format_code(fmt, fmt.value),
        KEY_FORMAT=_format_code(fmt, fmt.key),
        INTERPRET=interpret,
        HAS_MASK=mask is not None,
        HAS_SLIDING=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
    )
    scalars = (
        float(scale),
        float(softcap) if softcap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0,
        int(mask_offset),
        int(mask_len),
    )
    num_warps = 4 if block_m * block_d <= 64 * 128 else 8
    tiers, tier_strides, tier_flags = _tier_arguments(cold, D, page_table, k_pool, k_scale_arg, q_pos)

    _paged_attention_kernel[(num_programs, num_splits)](
        query, k_pool, v_pool, k_scale_arg, v_scale_arg, page_table, page_pos, q_pos, mask_arg, sink_arg,
        out, lse, mid_m, mid_l, mid_acc,
        *tiers,
        *scalars,
        Q, Hkv, N,
        *query.stride(), *k_pool.stride(), *v_pool.stride(), *ks, *vs,
        *page_table.stride(), *page_pos.stride(), *q_pos.stride(), *sm,
        *out.stride(), *ls, *xs, *tier_strides,
        GROUP=group, PAGE_SIZE=S, HEAD_DIM=D,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_SINK=s_aux is not None, SPLIT=split, STORE_LSE=store_lse,
        num_warps=num_warps,
        **groups, **flags, **tier_flags,
    )
    if split:
        _combine_splits_kernel[(B * Hq * Q,)](
            mid_m, mid_l, mid_acc, sink_arg, out, lse,
            Hq, Q, num_splits,
            *xs, *out.stride(), *ls,
            HEAD_DIM=D, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            HAS_SINK=s_aux is not None, STORE_LSE=store_lse,
            num_warps=4,
        )
    if out is not result:
        result.copy_(out @ rotation(D, device))
    if not return_page_mass:
        return result

    if N > 0:
        mass_block_q = 16 if Q <= 16 else 32
        mass_block_n = min(64, max(16, triton.next_power_of_2(S)))
        _page_mass_kernel[(B * Hq * N,)](
            query, k_pool, k_scale_arg, page_table, page_pos, q_pos, mask_arg, lse, page_mass,
            *(tiers[i] for i in (0, 1, 2, 4, 6)),  # the row maps, the cold keys and their scales, the rotation
            *scalars,
            Q, Hq, N,
            *query.stride(), *k_pool.stride(), *ks,
            *page_table.stride(), *page_pos.stride(), *q_pos.stride(), *sm,
            *ls, *page_mass.stride(), *tier_strides[0:3], *tier_strides[6:9],
            GROUP=group, PAGE_SIZE=S, HEAD_DIM=D,
            K_GROUP=groups["K_GROUP"], BLOCK_Q=mass_block_q, BLOCK_N=mass_block_n, BLOCK_D=block_d,
            num_warps=4,
            **flags, **{name: tier_flags[name] for name in ("TWO_TIERS", "COLD_KEY_FORMAT", "COLD_K_GROUP",
                                                            "COLD_K_ROTATED")},
        )
    return result, page_mass
