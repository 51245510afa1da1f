"""What the pages of one namespace look like, and the namespace that keeps other pages apart.

A page is identified by its chained content hash (``bytes``); the hash is only meaningful within a
*namespace*: everything that shapes the stored bytes (model fingerprint, dtype, page size, layer
windows, device type, page format, layout version). `store_namespace` combines them; any change gives
another namespace, so a changed model, dtype, page size or page format gets zero hits, never wrong
keys and values. The device *index* is refused: ``cuda:0`` and ``cuda:1`` compute the same bytes.

A `PageLayout` adds the tensors of one page (names, per-page shapes, dtypes): an entry holding ``n``
pages holds each tensor with shape ``(n, *shape)``. The store verifies these and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

STORE_FORMAT = 1  # version of the store's own entry layout (keys, metadata, run alignment)
ENTRY_TARGET_BYTES = 512 * 1024  # an entry (one I/O unit) holds enough pages to reach this...
MAX_PAGES_PER_ENTRY = 64  # ...but never more pages than this


def store_namespace(model_fingerprint: bytes, dtype: torch.dtype | str, page_size: int,
                    layer_windows: Sequence[int | None], device_type: str, page_format: str,
                    layout_version: int) -> str:
    """A hex name for the pages computed by this model, dtype, page size, windows, device type and format.

    ``device_type`` is a type (``"cpu"``, ``"cuda"``), never an index: ranks on ``cuda:0`` and ``cuda:1``
    share pages, CPU and CUDA do not (their numerics differ).
    """
    if not isinstance(model_fingerprint, bytes) or not model_fingerprint:
        raise ValueError(f"model_fingerprint must be non-empty bytes (hf_paged.prefix_index.model_fingerprint), "
                         f"got {type(model_fingerprint).__name__}")
    if not isinstance(device_type, str) or not device_type or not device_type.isalpha():
        raise ValueError(f"device_type must be a device type such as 'cpu' or 'cuda', without an index; got "
                         f"{device_type!r} (pass torch.device(...).type)")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if isinstance(layout_version, bool) or not isinstance(layout_version, int):
        raise ValueError(f"layout_version must be an int, got {layout_version!r}")
    if not isinstance(page_format, str) or not page_format:
        raise ValueError(f"page_format must be a non-empty name, got {page_format!r}")
    windows = [None if w is None else int(w) for w in layer_windows]
    described = json.dumps({
        "store_format": STORE_FORMAT, "model": model_fingerprint.hex(), "dtype": str(dtype).removeprefix("torch."),
        "page_size": page_size, "layer_windows": windows, "device_type": device_type,
        "page_format": page_format, "layout_version": layout_version,
    }, sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a page: its name, its shape per page and its dtype."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class PageLayout:
    """The namespace, format and tensors of the pages a store entry holds.

    Invariants: ``tensors`` is sorted by name, names are unique; ``pages_per_entry`` is a function of the
    tensors alone, so every process writing one namespace cuts a sequence into the same entries (runs of
    ``pages_per_entry`` pages starting at multiples of it, plus a shorter last run).
    """
    namespace: str
    page_format: str
    layout_version: int
    tensors: tuple[TensorSpec, ...]

    @classmethod
    def create(cls, *, model_fingerprint: bytes, dtype: torch.dtype | str, page_size: int,
               layer_windows: Sequence[int | None], device_type: str, page_format: str, layout_version: int,
               tensors: Mapping[str, tuple[Sequence[int], torch.dtype]]) -> "PageLayout":
        """The layout of pages computed by this model and stored as ``tensors`` (name -> (shape per page, dtype))."""
        namespace = store_namespace(model_fingerprint, dtype, page_size, layer_windows, device_type, page_format,
                                    layout_version)
        return cls(namespace, page_format, layout_version,
                   tuple(TensorSpec(name, tuple(int(d) for d in shape), dt)
                         for name, (shape, dt) in sorted(tensors.items())))

    def __post_init__(self):
        names = [t.name for t in self.tensors]
        if not names or names != sorted(set(names)):
            raise ValueError(f"a page layout needs unique tensor names in sorted order, got {names}")

    @property
    def page_bytes(self) -> int:
        return sum(t.page_bytes for t in self.tensors)

    @property
    def pages_per_entry(self) -> int:
        return max(1, min(MAX_PAGES_PER_ENTRY, math.ceil(ENTRY_TARGET_BYTES / max(1, self.page_bytes))))

    def entry_start(self, page: int) -> int:
        """The first page of the entry that holds page ``page`` of a sequence."""
        return page - page % self.pages_per_entry

    def check(self, tensors: Mapping[str, torch.Tensor], pages: int) -> None:
        """Raise ValueError unless ``tensors`` holds exactly this layout's tensors for ``pages`` pages."""
        expected = {t.name: t for t in self.tensors}
        if set(tensors) != set(expected):
            raise ValueError(f"pages to store must have the tensors {sorted(expected)}, got {sorted(tensors)}")
        for name, spec in expected.items():
            tensor = tensors[name]
            if tuple(tensor.shape) != (pages, *spec.shape) or tensor.dtype != spec.dtype:
                raise ValueError(f"tensor {name!r} of {pages} page(s) must be {spec.dtype} of shape "
                                 f"{(pages, *spec.shape)}, got {tensor.dtype} of shape {tuple(tensor.shape)}")
