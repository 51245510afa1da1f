"""The argument contract shared by the paged-attention kernels (Triton, CPU): shape, type, device and
index checks, and the mask's broadcast strides. Layout and semantics: :mod:`hf_paged.kernels.reference`.

Pools hold keys and values in a page format (`hf_paged.kv_formats`): ``"float"`` pools ``[P, S, Hkv, D]`` of a
floating dtype, or codes and float16 scales (``k_scale``/``v_scale``) in the shapes their format defines.

A layer of two tiers (`hf_paged.demotion`) passes its hot float pools as ``k_pool``/``v_pool`` and its cold ones as
a `ColdTier`: then the table's ids are page ids, and the tier's row maps say which pool row holds each.

The kernels read the pools at the page ids of ``page_table`` without bounds checks, so no call reaches
them unless every id is a hole (-1) or a page of the pools. Checking ids costs a reduction over the
table; a `PagedCache` step does it once per step and device (`mark_checked`), not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv_formats import PageFormat, page_format

_CHECKED = "_hf_paged_checked_pages"  # attribute of a page table: the pool size its ids were checked against


@dataclass(frozen=True)
class ColdTier:
    """The cold pools of a two-tier layer and where each page lives: page id ``p`` of a page table is row
    ``hot_row[p]`` of the hot (float) pools, or else row ``cold_row[p]`` of these pools in ``format`` (int8 or
    int4 codes with their float16 scales, layout of `hf_paged.kv_formats`; a `PageFormat`, since cold int4 pages
    of fewer than 16 tokens use per-token keys, not the per-page keys of the "int4" page format,
    `demotion.cold_page_format`); -1 in both: the id holds nothing and is skipped like a hole. Invariant (the
    owner's): no id has a row in both."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    format: PageFormat
    hot_row: torch.Tensor  # [ids] int64
    cold_row: torch.Tensor  # [ids] int64


def check_paged_args(query, k_pool, v_pool, page_table, page_pos, q_pos, mask, s_aux, k_scale=None, v_scale=None,
                     kv_format: str = "float", cold: ColdTier | None = None) -> PageFormat:
    """Raise ValueError/TypeError (naming the argument) unless the arguments meet the contract; -> the format."""
    fmt = page_format(kv_format)
    num_ids = check_pools(fmt, query, k_pool, v_pool, k_scale, v_scale, cold)
    check_call(query, k_pool.shape[2], num_ids, page_table, page_pos, q_pos)
    check_mask_and_sinks(query, mask, s_aux)
    return fmt


def check_pools(fmt: PageFormat, query, k_pool, v_pool, k_scale, v_scale, cold: ColdTier | None = None) -> int:
    """The pools (and a cold tier) hold pages of ``fmt`` for ``query``'s head dim, on its device; -> the number of
    page ids a table may name. Depends on the pools' shapes, dtypes, strides and devices only."""
    D = query.shape[3]
    _check_pools(fmt, D, k_pool, v_pool, k_scale, v_scale)
    num_ids = k_pool.shape[0] if cold is None else _check_cold(fmt, D, k_pool, v_pool, cold, query.device)
    _on_query_device(query, k_pool=k_pool, v_pool=v_pool, k_scale=k_scale, v_scale=v_scale)
    return num_ids


def check_call(query, Hkv: int, num_ids: int, page_table, page_pos, q_pos) -> None:
    """The query and index of a call on checked pools of ``Hkv`` heads and ``num_ids`` page ids."""
    B, Hq, Q, D = query.shape
    N = page_table.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if page_table.shape != (B, N) or page_pos.shape != (B, N) or q_pos.shape != (B, Q):  # (a torch.Size is a tuple)
        raise ValueError("page_table/page_pos must be [B, N] and q_pos [B, Q]")
    _on_query_device(query, page_table=page_table, page_pos=page_pos, q_pos=q_pos)
    if not marked(page_table, num_ids):
        check_index(page_table, page_pos, q_pos, num_ids)


def check_mask_and_sinks(query, mask, s_aux) -> None:
    """A call's optional mask ``[B or 1, 1 or Hq, Q, M]`` (bool) and sinks ``[Hq]``, on the query's device."""
    B, Hq, Q, _ = query.shape
    _on_query_device(query, mask=mask, s_aux=s_aux)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be bool, got {mask.dtype}")
        if mask.dim() != 4 or mask.shape[0] not in (1, B) or mask.shape[1] not in (1, Hq) or mask.shape[2] != Q:
            raise ValueError(f"mask must be [B or 1, 1 or Hq, Q, M], got {tuple(mask.shape)}")
    if s_aux is not None and s_aux.shape != (Hq,):
        raise ValueError(f"s_aux must be [Hq] = [{Hq}], got {tuple(s_aux.shape)}")


def _on_query_device(query, **tensors) -> None:
    """Raise ValueError, naming it, unless every tensor given (None: absent) is on the query's device."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device}, the query on {query.device}: move it to the query's "
                             "device")


def _check_cold(hot: PageFormat, D: int, k_pool, v_pool, cold: ColdTier, device) -> int:
    """The cold tier matches the hot pools (float, same slots and heads) and its row maps point into the pools of
    their tier; -> the number of page ids."""
    fmt = cold.format
    if hot.quantized or not fmt.quantized:
        raise ValueError(f"a ColdTier pairs float hot pools with quantized cold ones, got kv_format={hot.name!r} and "
                         f"cold kv_format={fmt.name!r}")
    _check_pools(fmt, D, cold.k_pool, cold.v_pool, cold.k_scale, cold.v_scale)
    if tuple(cold.k_pool.shape[1:3]) != tuple(k_pool.shape[1:3]):
        raise ValueError(f"cold pools hold pages of {tuple(cold.k_pool.shape[1:3])} (slots, heads), the hot pools "
                         f"{tuple(k_pool.shape[1:3])}")
    for name, rows in (("hot_row", cold.hot_row), ("cold_row", cold.cold_row)):
        if rows.dtype != torch.int64 or rows.dim() != 1 or rows.shape != cold.hot_row.shape or not rows.is_contiguous():
            raise ValueError(f"ColdTier.{name} must be a contiguous int64 [ids] tensor like hot_row, got {rows.dtype} "
                             f"{list(rows.shape)}")
        for tensor in (rows, cold.k_pool, cold.v_pool, cold.k_scale, cold.v_scale):
            if tensor.device != device:
                raise ValueError(f"the ColdTier's tensors must be on the query's device {device}")
    check_cold_rows(cold, k_pool.shape[0])
    return cold.hot_row.shape[0]


def check_cold_rows(cold: ColdTier, hot_pages: int) -> None:
    """The row maps point into the pools of their tier (the hot pools hold ``hot_pages`` pages): their values change
    as pages move between tiers, so a caller that keeps the rest of `check_pools` checks them at every call."""
    for name, rows, size in (("hot_row", cold.hot_row, hot_pages), ("cold_row", cold.cold_row, cold.k_pool.shape[0])):
        low, high = (int(x) for x in rows.aminmax()) if rows.numel() else (-1, -1)
        if low < -1 or high >= size:
            raise ValueError(f"ColdTier.{name} holds rows outside [-1, {size}) (its pools' pages)")


def _check_pools(fmt: PageFormat, D: int, k_pool, v_pool, k_scale, v_scale) -> None:
    """The pools (and scales) hold pages of ``fmt`` for head dim ``D``: shapes, dtypes, unit last strides."""
    if k_pool.dim() != 4:
        raise ValueError(f"k_pool must be [P, S, Hkv, W], got {tuple(k_pool.shape)}")
    pages = tuple(k_pool.shape[:3])
    if not fmt.quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale/v_scale belong to quantized pools: pass kv_format='int8', 'int4' or 'fp8_e4m3' "
                             "with them, or no scales with float pools")
        if k_pool.shape[3] != D or tuple(v_pool.shape) != tuple(k_pool.shape):
            raise ValueError(f"k_pool/v_pool must be [P, S, Hkv, {D}], got {tuple(k_pool.shape)}, "
                             f"{tuple(v_pool.shape)}")
        if not k_pool.dtype.is_floating_point or k_pool.element_size() < 2:
            raise TypeError(f"kv_format='float' reads float16/bfloat16/float32 pools, got {k_pool.dtype}: pass the "
                            "kv_format (and k_scale/v_scale) of quantized pools")
        return
    if D % fmt.packing:
        raise ValueError(f"kv_format={fmt.name!r} packs {fmt.packing} values a byte: the head dim must be a multiple "
                         f"of {fmt.packing}, got {D}")
    for name, codec, pool, scale in (("k", fmt.key, k_pool, k_scale), ("v", fmt.value, v_pool, v_scale)):
        want = (*pages, codec.width(D))
        if tuple(pool.shape) != want or pool.dtype != codec.dtype:
            raise ValueError(f"{name}_pool of kv_format={fmt.name!r} must be {codec.dtype} {list(want)}, got "
                             f"{pool.dtype} {list(pool.shape)}")
        want = ((pages[0], pages[2], codec.params_width(D)) if getattr(codec, "per_page", False)  # a page's
                else (*pages, codec.groups(D)))  # parameters, or a scale per group of each slot
        if scale is None or tuple(scale.shape) != want or scale.dtype != torch.float16:
            got = "none" if scale is None else f"{scale.dtype} {list(scale.shape)}"
            raise ValueError(f"{name}_scale of kv_format={fmt.name!r} must be torch.float16 {list(want)}, got {got}")
        if pool.stride(-1) != 1 or scale.stride(-1) != 1:
            raise ValueError(f"{name}_pool/{name}_scale of kv_format={fmt.name!r} need a unit last stride")


def check_index(page_table, page_pos, q_pos, num_pages: int) -> None:
    """Raise ValueError unless the index tensors are integers and every page id is -1 (a hole) or
    in ``[0, num_pages)``."""
    for name, tensor in (("page_table", page_table), ("page_pos", page_pos), ("q_pos", q_pos)):
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got {tensor.dtype}")
    if page_table.numel() == 0:
        return
    low, high = (int(x) for x in page_table.aminmax())
    if low < -1 or high >= num_pages:
        bad = low if low < -1 else high
        raise ValueError(f"page_table holds page id {bad}, but ids must be -1 (a hole) or a page of the pools, "
                         f"0 <= id < {num_pages}" + (" (the pools are empty)" if num_pages == 0 else ""))


def marked(page_table: torch.Tensor, num_pages: int) -> bool:
    """``page_table`` carries the mark of `mark_checked` for pools of at most ``num_pages`` pages: its ids hold there
    (its owner edits a marked table's ids only into holes)."""
    checked = getattr(page_table, _CHECKED, None)
    return checked is not None and checked <= num_pages


def mark_checked(page_table: torch.Tensor, page_pos, q_pos, num_pages: int) -> None:
    """Check the index once and remember it: later kernel calls on pools of at least ``num_pages``
    pages skip the reduction, and so does marking the same table again (its owner only ever edits
    a marked table's ids into holes)."""
    if getattr(page_table, _CHECKED, -1) >= num_pages:
        return
    check_index(page_table, page_pos, q_pos, num_pages)
    setattr(page_table, _CHECKED, num_pages)


def mask_strides(mask: torch.Tensor) -> list[int]:
    """Element strides of a checked ``[B or 1, 1 or Hq, Q, M]`` mask, 0 on its broadcast batch/head dims."""
    return [0 if i < 2 and mask.shape[i] == 1 else mask.stride(i) for i in range(4)]
