"""Paged attention on the CPU: a small C kernel that reads K/V in place through the page table.

Same arguments and semantics as :func:`hf_paged.kernels.triton_paged_attention.paged_attention_triton`
(defined by :func:`hf_paged.kernels.reference.paged_attention_reference`). It reads every K/V slot of
a row once for all the query heads of its KV group, so a decode step costs one pass over the live
pages, where SDPA's CPU kernel on the strided page view runs several times slower.

The C source (``cpu_paged_attention.c``) is compiled on first use with the system C compiler
(``$CC``, default ``cc``; ``-O3 -march=native -fopenmp``) into ``$HF_PAGED_CACHE_DIR/kernels``
(default ``~/.cache/hf_paged/kernels``), keyed by the source, the compiler and the CPU, and loaded
with ctypes only after :mod:`hf_paged.kernels.library_cache` verified it (private folder, owner,
checksum); a folder others can write is replaced by a private temporary one, with a warning.
:func:`unavailable_reason` says why it cannot be used (no compiler, build error); the attention then
falls back to the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

from ..kv_formats import PageFormat, page_format, slot_scale_strides
from . import library_cache
from .arguments import ColdTier, check_call, check_cold_rows, check_mask_and_sinks, check_pools, marked, mask_strides

__all__ = ["paged_attention_cpu", "prefill_attention_cpu", "prefill_entry", "unavailable_reason", "SUPPORTED_DTYPES"]

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros"]
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)  # of float pools
KV_FORMATS = ("float", "int8", "int4", "int2")  # the page formats it reads (hf_paged.kv_formats)
SYMBOLS = ("paged_attention_f32", "paged_attention_bf16", "paged_attention_int8", "paged_attention_int4",
           "paged_attention_int2", "paged_attention_f32_int8", "paged_attention_f32_int4", "paged_attention_f32_int2",
           "paged_attention_bf16_int8", "paged_attention_bf16_int4", "paged_attention_bf16_int2")
# (the first five by the C kernel's format number; then hot float pages and cold pages, `ColdTier`)
PREFILL_SYMBOLS = {  # `prefill_attention_cpu`'s entry points, by page format (float pages: by dtype)
    torch.float32: "prefill_attention_f32", torch.bfloat16: "prefill_attention_bf16", "int8": "prefill_attention_i8",
    "int4": "prefill_attention_i4", "int2": "prefill_attention_i2"}
MASS_HEADS = ("mean", "max")  # the page mass's head reductions the kernel does itself (`page_mass_heads`)
PAGE_MASS_SIGNALS = ("attention", "output")  # what the page mass measures (`page_mass_signal`, reference.py)
_SLOTS_PER_SPLIT = 512  # fewest token slots worth a split of their own (splits only feed threads)

_i64 = ctypes.c_int64
_i64x3, _i64x4 = _i64 * 3, _i64 * 4
_ptr = ctypes.c_void_p



class _PagedArgs(ctypes.Structure):
    """Mirror of the C ``PagedArgs`` struct (field order matters)."""

    _fields_ = [
        ("q", _ptr), ("q_stride", _i64x4),
        ("k", _ptr), ("v", _ptr), ("k_stride", _i64x3), ("v_stride", _i64x3), ("format", _i64),
        ("k_scale", _ptr), ("v_scale", _ptr), ("ks_stride", _i64x3), ("vs_stride", _i64x3),
        ("k_group", _i64), ("v_group", _i64), ("k_width", _i64), ("v_width", _i64), ("k_rotated", _i64),
        ("v_rotated", _i64),
        ("table", _ptr), ("page_pos", _ptr), ("q_pos", _ptr),
        ("B", _i64), ("Hq", _i64), ("Hkv", _i64), ("Q", _i64), ("D", _i64), ("S", _i64), ("N", _i64),
        ("scale", ctypes.c_float), ("softcap", ctypes.c_float), ("window", _i64),
        ("mask", _ptr), ("mask_stride", _i64x4), ("mask_offset", _i64), ("mask_len", _i64),
        ("mask_per_head", _i64),
        ("sinks", _ptr), ("out", _ptr), ("page_mass", _ptr), ("mass_heads", _i64), ("mass_output", _i64),
        ("splits", _i64), ("threads", _i64), ("partial", _ptr), ("entry_stats", _ptr),
        ("k_page_params", _i64), ("hot_row", _ptr), ("cold_row", _ptr), ("cold", _ptr), ("lse", _ptr),
    ]


class _PrefillArgs(ctypes.Structure):
    """Mirror of the C ``PrefillArgs`` struct (field order matters)."""

    _fields_ = [
        ("q", _ptr), ("q_stride", _i64x3), ("k", _ptr), ("v", _ptr), ("k_stride", _i64x3), ("v_stride", _i64x3),
        ("k_scale", _ptr), ("v_scale", _ptr), ("ks_stride", _i64x3), ("vs_stride", _i64x3),
        ("table", _ptr), ("width", _i64), ("segment", _ptr),
        ("segments", _i64), ("Hq", _i64), ("Hkv", _i64), ("D", _i64), ("S", _i64), ("threads", _i64),
        ("scale", ctypes.c_float), ("out", _ptr), ("out_stride", _i64x3), ("v_rotated", _i64),
    ]


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | str:
    """The loaded kernel library, or a string saying why it cannot be built or loaded."""
    library = library_cache.compiled_library(SOURCE, FLAGS, SYMBOLS + tuple(PREFILL_SYMBOLS.values()))
    for name in SYMBOLS + tuple(PREFILL_SYMBOLS.values()) if not isinstance(library, str) else ():
        getattr(library, name).argtypes = [ctypes.POINTER(_PagedArgs if name in SYMBOLS else _PrefillArgs)]
        getattr(library, name).restype = ctypes.c_int
    return library


def unavailable_reason() -> str | None:
    """None when the kernel is ready to run, else why not (it is built on the first call)."""
    library = _library()
    return library if isinstance(library, str) else None


def _set_pools(args: _PagedArgs, fmt: PageFormat, k_pool, v_pool, k_scale, v_scale) -> None:
    """The pool fields of ``args``: pointers, strides, format, and a quantized format's scales and groups."""
    D = args.D
    args.k, args.v = k_pool.data_ptr(), v_pool.data_ptr()
    args.k_stride, args.v_stride = _i64x3(*k_pool.stride()[:3]), _i64x3(*v_pool.stride()[:3])
    args.format = KV_FORMATS.index(fmt.name) + 1 if fmt.quantized else int(k_pool.dtype == torch.bfloat16)
    args.k_width, args.v_width = k_pool.shape[3], v_pool.shape[3]
    if fmt.quantized:
        args.k_scale, args.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
        args.ks_stride = _i64x3(*slot_scale_strides(fmt.key, k_scale))
        args.vs_stride = _i64x3(*slot_scale_strides(fmt.value, v_scale))
        args.k_group, args.v_group = fmt.key.group_size(D), fmt.value.group_size(D)
        args.k_rotated, args.v_rotated = fmt.key.rotated, fmt.value.rotated  # the kernel rotates q and out itself
        args.k_page_params = int(getattr(fmt.key, "per_page", False))


def _choose_num_splits(rows: int, num_slots: int, threads: int) -> int:
    """Enough (row, split) items to keep every thread busy; one split on one thread."""
    if threads <= 1:
        return 1
    wanted = math.ceil(2 * threads / max(rows, 1))
    return max(1, min(wanted, num_slots // _SLOTS_PER_SPLIT))


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


_POOL_ARGS = "_hf_paged_cpu_pool_args"  # attribute of a k_pool: the checked pool fields of its last call


def _pool_args(query, k_pool, v_pool, k_scale, v_scale, kv_format: str, cold: ColdTier | None
               ) -> tuple[_PagedArgs, int]:
    """(a `_PagedArgs` holding the pool fields of these checked pools, the number of page ids). Pools change only
    when they are reallocated, so both are kept on ``k_pool`` for the next call with the same tensors, format and
    head dim (and k_pool's pointer, shape and strides and v_pool's shape unchanged; the query's device is checked per
    call, the pools' CPU here); a two-tier layer's cold tier likewise (`_cold_stamp`: its `ColdTier` is made anew
    per call), but for its row maps' values, checked on every call (`check_cold_rows`)."""
    D = query.shape[3]
    stamp = (kv_format, D, k_pool.data_ptr(), k_pool.shape, k_pool.stride(), v_pool.shape, _cold_stamp(cold))
    kept = getattr(k_pool, _POOL_ARGS, None)
    if kept is not None and kept[0] == stamp and kept[1] is v_pool and kept[2] is k_scale and kept[3] is v_scale:
        if cold is not None:
            check_cold_rows(cold, k_pool.shape[0])
        return kept[4], kept[5]
    fmt = page_format(kv_format)
    num_ids = check_pools(fmt, query, k_pool, v_pool, k_scale, v_scale, cold)
    for name in (kv_format, *([] if cold is None else [cold.format.name])):
        if name not in KV_FORMATS:
            raise ValueError(f"the CPU kernel reads kv_format {', '.join(map(repr, KV_FORMATS))}, not {name!r} "
                             "(the Triton kernel on CUDA reads it)")
    if not (k_pool.is_cpu and v_pool.is_cpu) or (cold is not None and not (cold.hot_row.is_cpu
                                                                             and cold.k_pool.is_cpu)):
        raise ValueError("paged_attention_cpu needs CPU tensors")
    if not fmt.quantized and (k_pool.dtype not in SUPPORTED_DTYPES or v_pool.dtype != k_pool.dtype):
        raise TypeError(f"the CPU kernel reads float32 or bfloat16 pools, got {k_pool.dtype}/{v_pool.dtype}")
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("k_pool/v_pool need a unit stride on the head dimension")
    args = _PagedArgs(D=D, k_group=D, v_group=D)  # float pools: one group a row (set_pools sets a format's)
    _set_pools(args, fmt, k_pool, v_pool, k_scale, v_scale)
    setattr(k_pool, _POOL_ARGS, (stamp, v_pool, k_scale, v_scale, args, num_ids))
    return args, num_ids


def _cold_stamp(cold: ColdTier | None) -> tuple | None:
    """What `check_pools` read of a cold tier but its row maps' values: its format and each tensor's pointer, shape,
    strides, dtype and device (None without one)."""
    if cold is None:
        return None
    tensors = (cold.k_pool, cold.v_pool, cold.k_scale, cold.v_scale, cold.hot_row, cold.cold_row)
    return cold.format, *((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for t in tensors)


_INDEX_ARGS = "_hf_paged_cpu_index_args"  # attribute of a marked page table: the index fields of its calls


def _index_args(query, Hkv: int, S: int, num_ids: int, page_table, page_pos, q_pos, num_splits: int | None
                ) -> tuple:
    """(table, page_pos, q_pos as contiguous int64, N, splits, threads) of a call reading ``page_table``, checked
    (`check_call`: shapes against the query, devices, page ids of pools of ``num_ids`` ids). A table whose owner
    marked its ids checked (`arguments.mark_checked`: a cache's, shared by a step's layers) keeps them for the calls
    with the same index tensors, query batch, length and heads, pool heads and page size, split request and thread
    count, while the mark holds for these pools; int64 contiguous tensors only (the kernel reads them, so the owner's
    later edits are read too). An unmarked table is checked on every call: its ids may have changed."""
    B, Hq, Q, _ = query.shape
    threads = torch.get_num_threads()
    shape = (B, Hq, Q, Hkv, S, num_splits, threads)
    kept = getattr(page_table, _INDEX_ARGS, None)
    same_call = kept is not None and kept[0] is page_pos and kept[1] is q_pos and kept[2] == shape
    if same_call and marked(page_table, num_ids):
        return kept[3]
    check_call(query, Hkv, num_ids, page_table, page_pos, q_pos)
    if not (page_table.is_cpu and page_pos.is_cpu and q_pos.is_cpu):
        raise ValueError("paged_attention_cpu needs CPU tensors")
    N = page_table.shape[1]
    splits = max(1, min(int(num_splits or _choose_num_splits(B, N * S, threads)), max(N, 1)))
    index = (_int64(page_table), _int64(page_pos), _int64(q_pos))
    fields = (*index, N, splits, min(threads, B * splits))  # (waking a thread with nothing to do costs more than a row)
    if marked(page_table, num_ids) and all(a is b for a, b in zip(index, (page_table, page_pos, q_pos))):
        setattr(page_table, _INDEX_ARGS, (page_pos, q_pos, shape, fields))
    return fields


def paged_attention_cpu(
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
    num_splits: int | None = None,
    page_mass_heads: str | None = None,
    page_mass_signal: str = "attention",
    page_mass_out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_format: str = "float",
    cold: ColdTier | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Paged attention of ``query [B, Hq, Q, D]`` over ``k_pool/v_pool [P, S, Hkv, D]`` (CPU tensors).

    Arguments as in :func:`~hf_paged.kernels.triton_paged_attention.paged_attention_triton`; float pools must
    be float32 or bfloat16 with a unit last stride; ``kv_format`` may be any of `KV_FORMATS` (``"int8"`` and
    ``"int4"``/``"int2"`` pools are dequantized as they are read, their ``k_scale``/``v_scale`` beside them). With
    ``cold`` (a `ColdTier` of int8, int4 or int2 pages) the pools are a two-tier layer's hot float pages: a row's hot
    entries are read first, then its cold ones, dequantized as they are read (never copied at full precision). Returns
    ``out [B, Q, Hq, D]`` in ``query.dtype``, and float32 ``page_mass [B, Hq, N]`` (averaged over the queries)
    with ``return_page_mass``, or its heads' ``"mean"`` or ``"max"`` ``[B, N]`` with ``page_mass_heads``;
    ``page_mass_signal="output"`` (pages of one token): instead of each token's probability, how far it moves
    the head's output (reference.py). ``page_mass_out``: with ``page_mass_heads``, a contiguous float32 ``[B, N]``
    tensor the reduced page mass is written into (every entry) and returned, instead of a new one. ``return_lse``:
    also (last) each (query, head)'s log-sum-exp of its scores, float32 ``[B, Q, Hq]`` (-inf where it attends
    nothing; with sinks it counts the sink), to merge with attention over other tokens.
    """
    args, out, page_mass, entry = _prepare(query, k_pool, v_pool, page_table, page_pos, q_pos, scale, mask,
                                           mask_offset, sliding_window, softcap, s_aux, return_page_mass, num_splits,
                                           page_mass_heads, page_mass_signal, page_mass_out, k_scale, v_scale,
                                           kv_format, cold)
    lse = _lse_into(args, out) if return_lse else None
    _run(entry, args, out)
    if query.dtype != torch.float32:
        out = out.to(query.dtype)
    return _outputs(out, page_mass if return_page_mass else None, lse)


def _lse_into(args: _PagedArgs, out: torch.Tensor) -> torch.Tensor:
    """A float32 ``[B, Q, Hq]`` tensor the kernel writes each row's log-sum-exp into (``args.lse``)."""
    lse = torch.empty(out.shape[:3], dtype=torch.float32)
    args.lse = lse.data_ptr()
    return lse


def _outputs(out, page_mass, lse):
    """``out``, or ``(out, page_mass and / or lse)`` for those asked for."""
    extra = tuple(t for t in (page_mass, lse) if t is not None)
    return (out, *extra) if extra else out


_PLAIN_CALL = "_hf_paged_cpu_plain_call"  # attribute of a k_pool: the checked arguments of its last plain call
_USAGE_CALL = "_hf_paged_cpu_usage_call"  # the same for its last plain call with a page mass


def plain_attention_cpu(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                        page_pos: torch.Tensor, q_pos: torch.Tensor, scale: float, sliding_window: int | None = None,
                        softcap: float | None = None, usage: tuple[str, str, torch.Tensor] | None = None,
                        return_lse: bool = False):
    """`paged_attention_cpu` of float pools with no mask, sinks or cold tier: a cache's decode step. The call's
    checked arguments are kept on ``k_pool`` and copied by the next call with the same pools (``k_pool``'s pointer,
    shape and strides, ``v_pool`` itself and its shape), a float32 query of the same shape and strides, an index of
    the same shapes whose table is still marked checked (`arguments.mark_checked`; int64, contiguous, all on the
    CPU), the same options and thread count; it then sets only the pointers of the query, the index and the output
    (a layer passes the checks when its pages grow or its table's width changes, not at every step). ``usage``:
    (``page_mass_heads``, ``page_mass_signal``, ``page_mass_out``) of a bounded cache's step, the page mass reduced
    over the heads into that buffer (a contiguous float32 CPU ``[B, N]``), kept apart from the calls without.
    -> ``out [B, Q, Hq, D]`` in float32 (a float32 query's dtype), and with ``usage`` the buffer:
    ``(out, page_mass_out)``; ``return_lse``: and (last) the rows' log-sum-exp (`paged_attention_cpu`)."""
    mass = None if usage is None else usage[2]
    key = (k_pool.data_ptr(), k_pool.shape, k_pool.stride(), v_pool.shape, query.shape, query.stride(), query.dtype,
           page_table.shape, page_pos.shape, q_pos.shape, scale, sliding_window, softcap, torch.get_num_threads(),
           None if usage is None else (*usage[:2], mass.shape))
    name = _PLAIN_CALL if usage is None else _USAGE_CALL
    kept = getattr(k_pool, name, None)
    if kept is None or kept[0] != key or kept[1] is not v_pool or not marked(page_table, kept[2]) or not (
            query.is_cpu and page_table.is_cpu and page_pos.is_cpu and q_pos.is_cpu
            and page_pos.dtype == q_pos.dtype == torch.int64 and page_pos.is_contiguous() and q_pos.is_contiguous()
            and (mass is None or (mass.is_cpu and mass.dtype == torch.float32 and mass.is_contiguous()))):
        heads, signal = (None, "attention") if usage is None else usage[:2]
        args, out, _, entry = _prepare(query, k_pool, v_pool, page_table, page_pos, q_pos, scale, None, 0,
                                       sliding_window, softcap, None, usage is not None, None, heads, signal, mass,
                                       None, None, "float", None)
        if query.dtype == torch.float32 and args.table == page_table.data_ptr():  # (the index as given: no copy)
            setattr(k_pool, name, (key, v_pool, getattr(k_pool, _POOL_ARGS)[5], entry,
                                   _PagedArgs.from_buffer_copy(args)))
        lse = _lse_into(args, out) if return_lse else None
        _run(entry, args, out)
        out = out if query.dtype == torch.float32 else out.to(query.dtype)
        return _outputs(out, mass, lse)
    args = _PagedArgs.from_buffer_copy(kept[4])
    out = torch.empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3], dtype=torch.float32)
    args.q, args.out = query.data_ptr(), out.data_ptr()
    args.table, args.page_pos, args.q_pos = page_table.data_ptr(), page_pos.data_ptr(), q_pos.data_ptr()
    if mass is not None:
        args.page_mass = mass.data_ptr()
    lse = _lse_into(args, out) if return_lse else None
    _run(kept[3], args, out)
    return _outputs(out, mass, lse)


def _run(entry, args: _PagedArgs, out: torch.Tensor) -> None:
    """Call the kernel's ``entry`` on ``args`` (nothing to do for an empty output)."""
    if out.numel() and entry(ctypes.byref(args)) != 0:
        raise MemoryError("the hf_paged CPU kernel could not allocate its scratch memory")


def _prepare(query, k_pool, v_pool, page_table, page_pos, q_pos, scale, mask, mask_offset, sliding_window, softcap,
             s_aux, return_page_mass, num_splits, page_mass_heads, page_mass_signal, page_mass_out, k_scale, v_scale,
             kv_format, cold) -> tuple:
    """The checked arguments of a `paged_attention_cpu` call: (``_PagedArgs``, ``out``, ``page_mass`` or None, the
    library's entry point). The tensors and structs made here that the arguments point to (a converted query or index,
    sinks, the cold pools' fields) are kept alive on them (``_kept``)."""
    library = _library()
    if isinstance(library, str):
        raise RuntimeError(f"The hf_paged CPU kernel is unavailable: {library}")
    B, Hq, Q, D = query.shape
    S, Hkv = k_pool.shape[1:3]
    if not query.is_cpu:
        raise ValueError("paged_attention_cpu needs CPU tensors")
    pools, num_ids = _pool_args(query, k_pool, v_pool, k_scale, v_scale, kv_format, cold)
    table, first, qpos, N, splits, threads = _index_args(query, Hkv, S, num_ids, page_table, page_pos, q_pos,
                                                         num_splits)
    if mask is not None or s_aux is not None:
        check_mask_and_sinks(query, mask, s_aux)
    if page_mass_heads is not None and page_mass_heads not in MASS_HEADS:
        raise ValueError(f"page_mass_heads must be None or one of {MASS_HEADS}, got {page_mass_heads!r}")
    if page_mass_signal != "attention" and (page_mass_signal not in PAGE_MASS_SIGNALS or S != 1):
        raise ValueError(f"page_mass_signal must be one of {PAGE_MASS_SIGNALS} ('output' with pages of one token), "
                         f"got {page_mass_signal!r} with pages of {S}")
    q32 = query if query.dtype == torch.float32 else query.float()
    out = torch.empty(B, Q, Hq, D, dtype=torch.float32)
    page_mass = None
    if return_page_mass and page_mass_out is not None:
        if not (page_mass_heads and page_mass_out.shape == (B, N) and page_mass_out.dtype == torch.float32
                and page_mass_out.is_cpu and page_mass_out.is_contiguous()):
            raise ValueError(f"page_mass_out must be a contiguous float32 CPU tensor [B, N] = [{B}, {N}] with "
                             f"page_mass_heads, got {tuple(page_mass_out.shape)} {page_mass_out.dtype}")
        page_mass = page_mass_out
    elif return_page_mass:
        page_mass = torch.zeros((B, N) if page_mass_heads else (B, Hq, N), dtype=torch.float32)
    args = _PagedArgs.from_buffer_copy(pools)
    args.q, args.q_stride[:] = q32.data_ptr(), q32.stride()
    args.table, args.page_pos, args.q_pos = table.data_ptr(), first.data_ptr(), qpos.data_ptr()
    args.B, args.Hq, args.Hkv, args.Q, args.S, args.N = B, Hq, Hkv, Q, S, N
    args.scale, args.softcap, args.window = scale, softcap or 0.0, sliding_window or 0
    args.out = out.data_ptr()
    if page_mass is not None:
        args.page_mass = page_mass.data_ptr()
        args.mass_heads = 0 if page_mass_heads is None else 1 + MASS_HEADS.index(page_mass_heads)
        args.mass_output = page_mass_signal == "output"
    args.splits, args.threads = splits, threads
    if mask is not None:
        strides = mask_strides(mask)
        args.mask, args.mask_stride = mask.data_ptr(), _i64x4(*strides)  # bool: one byte per element
        args.mask_offset, args.mask_len, args.mask_per_head = int(mask_offset), mask.shape[3], int(strides[1] != 0)
    if s_aux is not None:
        sinks = s_aux.float().contiguous()
        args.sinks = sinks.data_ptr()
    symbol = SYMBOLS[args.format]
    if cold is not None:  # the cold pools: the same arguments with the pool fields of the cold format
        cold_args = _PagedArgs.from_buffer_copy(args)
        _set_pools(cold_args, cold.format, cold.k_pool, cold.v_pool, cold.k_scale, cold.v_scale)
        args.hot_row, args.cold_row = cold.hot_row.data_ptr(), cold.cold_row.data_ptr()
        args.cold = ctypes.addressof(cold_args)
        symbol = f"{symbol}_{cold.format.name}"
    args._kept = (q32, table, first, qpos, sinks if s_aux is not None else None,
                  cold_args if cold is not None else None)
    return args, out, page_mass, getattr(library, symbol)


def prefill_entry(kv_format: str, pool_dtype: torch.dtype) -> str | None:
    """The prefill kernel's entry point (`PREFILL_SYMBOLS`) for pages of ``kv_format`` whose pools hold
    ``pool_dtype`` (float pages go by their dtype), or None when it reads no such pages."""
    return PREFILL_SYMBOLS.get(pool_dtype if kv_format == "float" else kv_format)


def prefill_attention_cpu(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                          segments: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, kv_format: str = "float") -> torch.Tensor:
    """Causal attention of a packed step's prefill chunks over their sequences' pages, read in place.

    ``query [T, Hq, D]`` float32 (any strides): the step's packed queries; ``k_pool``/``v_pool [P, S, Hkv, W]``
    pages of ``kv_format``, with ``k_scale``/``v_scale`` as `paged_attention_cpu` takes them: "float" (float32 or
    bfloat16, no scales), "int8", "int4" or "int2" (`PREFILL_SYMBOLS`; values of one group a row, as those formats
    store them); ``table [n, W]`` int64: segment i's page table (every entry a page id, padding included);
    ``segments [n, 3]`` int64 rows (start, length, past): segment i's queries are packed tokens ``start ..
    start + length`` at positions ``past ..``, and each attends its sequence's tokens ``0 ..`` its position.
    Returns ``out [T, Hq, D]`` float32 whose segments' rows are the attention (others undefined). The index is
    checked on every call (a few reductions: a prefill call's arithmetic dwarfs them)."""
    library = _library()
    if isinstance(library, str):
        raise RuntimeError(f"the hf_paged CPU kernel is unavailable: {library}")
    fmt = page_format(kv_format)
    T, Hq, D = query.shape
    entry = prefill_entry(kv_format, k_pool.dtype)
    if entry is None or v_pool.dtype != k_pool.dtype or (fmt.quantized and fmt.value.groups(D) != 1):
        raise ValueError("prefill_attention_cpu reads float32 or bfloat16 pools of one dtype, or int8, int4 or int2 "
                         f"pages, got kv_format={kv_format!r} with {k_pool.dtype} and {v_pool.dtype} pools")
    Hkv = k_pool.shape[2] if k_pool.dim() == 4 else 0
    if query.dtype != torch.float32 or D % 16 or not Hkv or Hq % Hkv:
        raise ValueError(f"prefill_attention_cpu needs a float32 query [T, Hq, D] with D a multiple of 16 and Hq a "
                         f"multiple of the pools' {Hkv} heads, got {tuple(query.shape)} {query.dtype}")
    check_pools(fmt, query[None], k_pool, v_pool, k_scale, v_scale)
    if k_pool.stride(3) != 1 or v_pool.stride(3) != 1:
        raise ValueError("prefill_attention_cpu reads pools with contiguous rows (a unit last stride)")
    P, S = k_pool.shape[:2]
    if not (query.is_cpu and k_pool.is_cpu and v_pool.is_cpu and table.is_cpu and segments.is_cpu):
        raise ValueError("prefill_attention_cpu needs CPU tensors")
    if table.dtype != torch.int64 or segments.dtype != torch.int64 or not (
            table.is_contiguous() and segments.is_contiguous()) or segments.shape != (table.shape[0], 3):
        raise ValueError("prefill_attention_cpu needs a contiguous int64 table [n, W] and segments [n, 3]")
    start, length, past = segments.unbind(1)
    if table.numel() and not (0 <= int(table.min()) and int(table.max()) < P):
        raise ValueError(f"page ids must lie in [0, {P}): the table holds {int(table.min())}..{int(table.max())}")
    if segments.numel() and not (bool((length > 0).all()) and bool((start >= 0).all()) and bool(
            (past >= 0).all()) and int((start + length).max()) <= T and int(
            (past + length).max()) <= table.shape[1] * S):
        raise ValueError("segments must have queries (length > 0) within the packed step's tokens, and their "
                         f"tokens (past + length) within their table's {table.shape[1]} pages of {S}")
    out = torch.empty(T, Hq, D, dtype=torch.float32)
    args = _PrefillArgs(
        q=query.data_ptr(), q_stride=_i64x3(*query.stride()), k=k_pool.data_ptr(), v=v_pool.data_ptr(),
        k_stride=_i64x3(*k_pool.stride()[:3]), v_stride=_i64x3(*v_pool.stride()[:3]), table=table.data_ptr(),
        width=table.shape[1], segment=segments.data_ptr(), segments=segments.shape[0], Hq=Hq, Hkv=Hkv, D=D, S=S,
        threads=torch.get_num_threads(), scale=scale, out=out.data_ptr(), out_stride=_i64x3(*out.stride()))
    if fmt.quantized:
        args.k_scale, args.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
        args.ks_stride = _i64x3(*slot_scale_strides(fmt.key, k_scale))
        args.vs_stride = _i64x3(*slot_scale_strides(fmt.value, v_scale))
        args.v_rotated = fmt.value.rotated
    if segments.shape[0] and getattr(library, entry)(ctypes.byref(args)):
        raise MemoryError("the hf_paged CPU kernel could not allocate its scratch memory")
    return out
