"""The int4 and int2 page formats' encoders in C, for a step's writes on the CPU (``cpu_page_codecs.c``).

A decode step writes one token per row into each layer's pages; in torch, encoding int4 keys (KIVI: a page
encoded over all its tokens, `hf_paged.kv_formats.PageChannelCodec`) and values (`PackedCodec`) takes dozens of
small tensor operations per layer, more than the attention itself. These functions do the same arithmetic in
one pass, bit-exact with the torch encoders (tests/test_page_codecs.py), writing straight into the pools. They
serve finite float32 input only: each returns False, having written nothing, when a value is not finite (the
torch encoder, which keeps such values out of the other tokens' ranges, then runs). The library is built like
the attention kernel's (`library_cache.compiled_library`), without fast-math; `available` says whether it is.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import library_cache

SOURCE = Path(__file__).with_name("cpu_page_codecs.c")
FLAGS = ["-O2", "-march=native", "-fPIC", "-shared", "-ffp-contract=off"]  # no fast-math: bit-exact with torch
SYMBOLS = ("encode_page_keys", "encode_packed_values")

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | str:
    library = library_cache.compiled_library(SOURCE, FLAGS, SYMBOLS)
    if not isinstance(library, str):
        library.encode_page_keys.argtypes = [_P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P]
        library.encode_packed_values.argtypes = [_P, _P, _I, _I, _I, _I, _P, _P]
        for name in SYMBOLS:
            getattr(library, name).restype = ctypes.c_int
    return library


def available() -> bool:
    """The encoders are built and loaded (else the torch encoders serve every write)."""
    return not isinstance(_library(), str)


def _pool_ready(*tensors: torch.Tensor) -> bool:
    return all(t.is_cpu and t.is_contiguous() for t in tensors)


def encode_page_keys(keys: torch.Tensor, targets: list[int], residual: torch.Tensor, rows: list[int],
                     filled: list[int], pages: list[int], codes: torch.Tensor, params: torch.Tensor) -> bool:
    """Write float32 ``keys [T, H, D]`` into the flat slots ``targets`` of ``residual [R, S, H, D]``, then encode
    pages ``pages`` from their keys ``residual[rows]``, of which the first ``filled`` slots hold tokens, into
    ``codes [P, S, H, D * bits / 8]`` (the codes' width says the bits: 4 or 2) and ``params [P, H, 3 D / 2]``
    (float16), as `PageChannelCodec(bits).encode_pages` does. -> False when the pages' keys are not all finite (the
    residual holds the new keys, nothing else written)."""
    _, S, H, D = residual.shape
    bits = codes.shape[3] * 8 // D
    keys = keys.contiguous()
    assert keys.dtype == residual.dtype == torch.float32 and params.dtype == torch.float16
    assert _pool_ready(residual, codes, params) and keys.shape[1:] == residual.shape[2:] == (H, D)
    index = torch.tensor([*rows, *filled, *pages, *targets], dtype=torch.int64)
    return _library().encode_page_keys(keys.data_ptr(), residual.data_ptr(), index.data_ptr(), len(targets),
                                       len(pages), S, H, D, bits, codes.data_ptr(), params.data_ptr()) == 0


def encode_packed_values(rotated: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor,
                       scales: torch.Tensor) -> bool:
    """Encode float32 ``rotated [T, H, D]`` (values in the rotated basis) into the flat slots ``slots [T]`` of
    ``codes [P, S, H, D * bits / 8 + 1]`` (the codes' width says the bits: 4 or 2) and ``scales [P, S, H, 1]``
    (float16), as `PackedCodec(None, bits=bits).encode` does. -> False, nothing written, when a value is not finite."""
    T, H, D = rotated.shape
    bits = (codes.shape[3] - 1) * 8 // D
    slots = slots.to(torch.int64).contiguous()
    assert rotated.dtype == torch.float32 and _pool_ready(rotated, codes, scales) and scales.dtype == torch.float16
    return _library().encode_packed_values(rotated.data_ptr(), slots.data_ptr(), T, H, D, bits, codes.data_ptr(),
                                         scales.data_ptr()) == 0
