"""Packed CPU weights on 2 MB pages (Linux transparent huge pages, ``madvise(MADV_COLLAPSE)``).

A decode step of a few rows streams every weight of the model once; on 4 KB pages the CPU's TLB misses at every
page and its hardware prefetchers stop at every page boundary. `move_to_huge_pages` asks the kernel to back the
memory of given tensors with 2 MB pages in place (``MADV_HUGEPAGE``, then ``MADV_COLLAPSE``, Linux >= 6.1, which
copies the small pages into huge ones synchronously). Invariants: only whole 2 MB ranges inside a tensor's own
memory are advised (its ragged ends stay on small pages; no other allocation is touched); values never change;
where the kernel cannot (another OS, an older kernel, transparent huge pages set to "never", no free huge page)
nothing happens and the bytes moved say so (0).
"""

from __future__ import annotations

import ctypes
import gc
import sys

import torch

__all__ = ["move_to_huge_pages", "packed_weights_to_huge_pages", "HUGE_PAGE"]

HUGE_PAGE = 2 << 20  # bytes of an x86-64 / arm64 transparent huge page
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25


def _libc():
    """libc's ``madvise``, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


_LIBC = _libc()


def _memory(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of a CPU tensor's memory: a oneDNN (mkldnn) tensor's buffer, else its storage."""
    if tensor.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(tensor), torch.ops.mkldnn._nbytes(tensor)
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def move_to_huge_pages(tensors) -> int:
    """Back the whole 2 MB ranges inside each CPU tensor's memory with huge pages; -> the bytes now on them (ranges
    the kernel refused are not counted)."""
    moved = 0
    for tensor in tensors:
        if _LIBC is None or tensor.device.type != "cpu":
            continue
        address, size = _memory(tensor)
        for page in range(-(-address // HUGE_PAGE) * HUGE_PAGE, address + size - HUGE_PAGE + 1, HUGE_PAGE):
            if (_LIBC.madvise(page, HUGE_PAGE, _MADV_HUGEPAGE) == 0
                    and _LIBC.madvise(page, HUGE_PAGE, _MADV_COLLAPSE) == 0):
                moved += HUGE_PAGE
    return moved


def packed_weights_to_huge_pages() -> int:
    """`move_to_huge_pages` for every oneDNN-packed tensor alive in the process: what inductor's freezing made of a
    compiled model's linear weights (held by its compiled graphs only). -> bytes moved."""
    return move_to_huge_pages(o for o in gc.get_objects()
                              if type(o) in (torch.Tensor, torch.nn.Parameter) and o.is_mkldnn)
