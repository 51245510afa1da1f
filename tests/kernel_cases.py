"""Paged-attention test cases shared by the kernel tests (Triton and CPU): random inputs with shuffled
pages, -1 holes, evicted pages, NaN in every slot that holds no token, masks, windows, softcaps, sinks."""

from __future__ import annotations

import math

import torch

from hf_paged.kernels.reference import paged_attention_reference
from hf_paged.kv_formats import QuantizedPages, page_format

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
QUANTIZED_FORMATS = ("int8", "int4", "int2", "fp8_e4m3")


def make_case(
    *,
    B: int,
    Hq: int,
    Hkv: int,
    D: int,
    S: int,
    Q: int,
    lengths: list[int],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    holes: bool = True,
    drop_page: bool = False,
    pad: list[int] | None = None,
    mask_per_head: bool = False,
    mask_offset: int = 0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sink: bool = False,
    device: torch.device = torch.device("cpu"),
) -> dict:
    """Random paged-attention inputs.

    Row ``b`` holds ``lengths[b]`` tokens (positions ``0..L-1``; the ``Q`` queries
    are the last ``Q`` of them, i.e. they continue a cache).  Physical pages are a
    random permutation of the pool, page-table entries are shuffled within the
    row, ``-1`` holes (with garbage ``page_pos``) are inserted, and with
    ``drop_page`` one middle page of row 0 is evicted (a gap in positions).
    Slots that hold no token (past the row's length) and unused pages are NaN:
    the kernel must never read them into the result.  With ``pad``, row ``b``
    has ``pad[b]`` left-padding tokens, hidden by a 4D causal+padding mask.
    """
    g = torch.Generator().manual_seed(seed)
    pages_per_row = [math.ceil(L / S) for L in lengths]
    P = sum(pages_per_row) + 3
    perm = torch.randperm(P, generator=g).tolist()
    k_pool = torch.randn(P, S, Hkv, D, generator=g)
    v_pool = torch.randn(P, S, Hkv, D, generator=g)
    used = torch.zeros(P, dtype=torch.bool)

    rows = []
    nxt = 0
    for b, L in enumerate(lengths):
        entries = []
        for j in range(pages_per_row[b]):
            page = perm[nxt]
            nxt += 1
            used[page] = True
            filled = min(S, L - j * S)
            k_pool[page, filled:] = float("nan")
            v_pool[page, filled:] = float("nan")
            entries.append((page, j * S))
        if drop_page and b == 0 and len(entries) >= 3:
            entries.pop(len(entries) // 2)
        order = torch.randperm(len(entries), generator=g).tolist()
        entries = [entries[i] for i in order]
        if holes:
            at = int(torch.randint(0, len(entries) + 1, (1,), generator=g))
            entries.insert(at, (-1, int(torch.randint(-50, 50, (1,), generator=g))))
        rows.append(entries)
    k_pool[~used] = float("nan")
    v_pool[~used] = float("nan")

    N = max(len(e) for e in rows) + 1  # at least one trailing -1 entry
    page_table = torch.full((B, N), -1, dtype=torch.int32)
    page_pos = torch.randint(-50, 50, (B, N), generator=g, dtype=torch.int64)
    for b, entries in enumerate(rows):
        for n, (page, first) in enumerate(entries):
            page_table[b, n] = page
            if page >= 0:
                page_pos[b, n] = first

    q_pos = torch.stack([torch.arange(L - Q, L) for L in lengths]).to(torch.int64)
    # A transposed [B, Q, Hq, D] tensor, as transformers hands it to attention functions.
    query = torch.randn(B, Q, Hq, D, generator=g).transpose(1, 2)

    mask = None
    if pad is not None:
        M = max(lengths) - mask_offset
        p = torch.arange(M) + mask_offset  # logical position of each mask column
        mask = (p[None, None, :] >= torch.tensor(pad)[:, None, None]) & (p[None, None, :] <= q_pos[:, :, None])
        mask = mask[:, None]  # [B, 1, Q, M]
        if mask_per_head:
            mask = mask.expand(B, Hq, Q, M).clone()
            mask &= torch.rand(B, Hq, Q, M, generator=g) > 0.2  # heads see different tokens

    return dict(
        query=query.to(dtype).to(device),
        k_pool=k_pool.to(dtype).to(device),
        v_pool=v_pool.to(dtype).to(device),
        page_table=page_table.to(device),
        page_pos=page_pos.to(device),
        q_pos=q_pos.to(device),
        scale=D**-0.5,
        mask=None if mask is None else mask.to(device),
        mask_offset=mask_offset,
        sliding_window=sliding_window,
        softcap=softcap,
        s_aux=(torch.randn(Hq, generator=g) + 1.0).to(device) if sink else None,
    )


def quantize_case(case: dict, kv_format: str) -> dict:
    """``case`` with its pools stored in ``kv_format``: every slot written through `QuantizedPages` (the NaN
    of the slots that hold no token becomes NaN scales), the pools replaced by ``kernel_operands()``."""
    P, S, H, D = case["k_pool"].shape
    pages = QuantizedPages(page_format(kv_format), S, H, D, D, case["k_pool"].dtype, case["k_pool"].device)
    pages.grow_to(P)
    slots = torch.arange(P * S, device=case["k_pool"].device)
    pages.write(slots, case["k_pool"].flatten(0, 1), case["v_pool"].flatten(0, 1))
    return {**{k: v for k, v in case.items() if k not in ("k_pool", "v_pool")}, **pages.kernel_operands()}


def two_tier_case(case: dict, cold_format: str, seed: int = 0, cold_share: float = 0.5) -> dict:
    """``case`` with its pages in a two-tier layer (`hf_paged.demotion.MixedPages`): every page written hot, then a
    random ``cold_share`` of them (interleaved with the hot ones in every row) demoted to ``cold_format``; the pools
    replaced by the layer's ``kernel_operands()`` (hot pools, and the cold ones with the row maps). -> (case, layer)"""
    from hf_paged.demotion import ColdPages

    P, S, H, D = case["k_pool"].shape
    layer = ColdPages(cold_format, S).make_layer(0, S, H, D, D, case["k_pool"].dtype, case["k_pool"].device)
    layer.grow_to(P)
    layer.write(torch.arange(P * S, device=case["k_pool"].device), case["k_pool"].flatten(0, 1),
                case["v_pool"].flatten(0, 1))
    g = torch.Generator().manual_seed(seed)
    layer.demote(torch.nonzero(torch.rand(P, generator=g) < cold_share)[:, 0].numpy())
    return {**{k: v for k, v in case.items() if k not in ("k_pool", "v_pool")}, **layer.kernel_operands()}, layer


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


KERNEL_CASES = {
    # MHA, page size 1, decode, rows of different lengths, shuffled pages, -1 holes.
    "mha-page1-decode-fp32": dict(B=3, Hq=2, Hkv=2, D=32, S=1, Q=1, lengths=[5, 9, 2]),
    # GQA, page size 3, chunked prefill continuing a cache, left padding via a 4D mask,
    # an evicted page (gap in positions).
    "gqa-page3-chunk-leftpad-fp32": dict(B=2, Hq=4, Hkv=2, D=32, S=3, Q=4, lengths=[11, 8], pad=[3, 0],
                                         drop_page=True),
    # MQA, page size 16, decode in bf16 with sliding window, softcap and sinks.
    "mqa-page16-decode-bf16-window-softcap-sink": dict(B=2, Hq=4, Hkv=1, D=64, S=16, Q=1, lengths=[40, 21],
                                                       sliding_window=13, softcap=5.0, sink=True,
                                                       dtype=torch.bfloat16),
    # Non-power-of-two head dim, per-head mask with an offset, fp16, Q > 1.
    "gqa-d24-perhead-mask-offset-fp16": dict(B=2, Hq=4, Hkv=2, D=24, S=4, Q=3, lengths=[14, 9], pad=[0, 2],
                                             mask_per_head=True, mask_offset=2, softcap=3.0, sink=True,
                                             dtype=torch.float16),
}


def assert_matches_reference(case: dict, out: torch.Tensor, mass: torch.Tensor, mass_tol: float | None = None,
                             tol: float | None = None) -> None:
    """A kernel's ``out`` and ``page_mass`` for ``case`` (float or quantized pools) agree with the float64
    reference (``out`` within ``tol`` and page mass within ``mass_tol``, both by default the dtype's tolerance),
    and ``-1`` page-table entries get no mass."""
    ref_out, ref_mass = paged_attention_reference(**case, return_page_mass=True)
    tol = TOL[case["query"].dtype] if tol is None else tol
    assert rel_err(out, ref_out) <= tol, rel_err(out, ref_out)
    assert float((mass - ref_mass).abs().max()) <= (TOL[case["query"].dtype] if mass_tol is None else mass_tol)
    assert torch.all(mass.masked_select((case["page_table"] < 0)[:, None, :]) == 0)
