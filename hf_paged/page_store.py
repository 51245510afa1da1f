"""The page store: the one owner of K/V bytes for one block manager.

A `BlockManager` hands out page ids; the store holds what those pages contain, for every layer that
shares the manager's ids: one `LayerPages` per layer, in one page format. Nothing else indexes a pool
tensor: the caches write a step's slots and copy pages (copy-on-write) through it, attention reads
through it (`LayerPages.gather`, the float slab view `FloatPages.slab_view`, or the kernel operands).

`LayerPages` is the interface of one layer's pages in one format (``"float"``: `FloatPages`; the quantized
formats of `hf_paged.kv_formats`: `QuantizedPages`):

    num_pages, page_size, dtype (of the keys/values it returns), device
    grow_to(num_pages)                     keep contents; new pages are zero (never NaN: masked slots are
                                           multiplied by 0)
    write(slots [T], keys [T, H, D], values [T, H, Dv])
    copy_pages(src [C], dst [C])           bytes (and scales, in quantized formats)
    gather(pages [...]) -> keys [..., S, H, D], values [..., S, H, Dv]   (dequantized)
    kernel_operands() -> dict              keyword arguments of the paged kernels: k_pool, v_pool, k_scale,
                                           v_scale (None for float pages), kv_format
    page_bytes() -> int                    one page, keys + values (+ scales)
    residual_bytes() -> int                float keys kept for partial pages (int4's per-page keys; else 0)
    forget_residuals(pages [collection])   drop the residuals of these pages (overwritten as stored, or free)

`make_layer_pages` builds one from a format name.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from .kv_formats import QuantizedPages, check_kv_format, page_format


class FloatPages:
    """A layer's pages as ``[num_pages, page_size, heads, dim]`` key and value tensors in the compute dtype.

    Shared by every fork of a cache (forks share page ids, hence bytes). The slot-major views used for
    writes are made once per tensor and grad mode (autograd forbids writing, with grad on, into a view
    made under no_grad).
    """

    kv_format = "float"

    def __init__(self, page_size: int, heads: int, head_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.page_size, self.dtype, self.device = page_size, dtype, torch.device(device)
        self.keys = torch.zeros((0, page_size, heads, head_dim), dtype=dtype, device=device)
        self.values = torch.zeros((0, page_size, heads, value_dim), dtype=dtype, device=device)
        self._slot_rows: tuple = (None, None, None, None, None)  # (keys, values, grad mode, key rows, value rows)

    @property
    def num_pages(self) -> int:
        return self.keys.shape[0]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(heads, head_dim, value_dim, page_size): what every write must match."""
        return self.keys.shape[2], self.keys.shape[3], self.values.shape[3], self.page_size

    def grow_to(self, num_pages: int) -> None:
        """At least ``num_pages`` pages, contents kept (callers' managers grow geometrically: amortised)."""
        have = self.keys.shape[0]
        if have >= num_pages:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((num_pages, *old.shape[1:]))
            new[:have] = old
            setattr(self, name, new)

    def _rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys``/``values`` as ``[pages * page_size, heads, dim]``, one row per slot."""
        keys, values, grad, key_rows, value_rows = self._slot_rows
        if keys is not self.keys or values is not self.values or grad != torch.is_grad_enabled():
            key_rows, value_rows = self.keys.flatten(0, 1), self.values.flatten(0, 1)
            self._slot_rows = (self.keys, self.values, torch.is_grad_enabled(), key_rows, value_rows)
        return key_rows, value_rows

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Token t's key and value go to slot ``slots[t]`` (``page * page_size + offset``), in the pages' dtype."""
        key_rows, value_rows = self._rows()
        dtype = self.dtype  # (a conversion to the same dtype still costs a dispatch: skipped)
        key_rows.index_copy_(0, slots, keys if keys.dtype == dtype else keys.to(dtype))
        value_rows.index_copy_(0, slots, values if values.dtype == dtype else values.to(dtype))

    def write_in_graph(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`write` as one node of a compiled graph (`write_slots`): the pools are written in place, never copied."""
        write_slots(self.keys, self.values, slots, keys, values)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.keys[dst] = self.keys[src]
        self.values[dst] = self.values[src]

    def gather(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages' keys and values, ``[..., S, H, D]`` (-1 entries must be clamped by the caller)."""
        return self.keys[pages], self.values[pages]

    def slab_view(self, base: int, stride: int, rows: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[rows, tokens, H, D]`` of rows laid out on a slab (row b's pages are ``base + b * stride
        + i``): strided views, no copy. Float pages only (a quantized format has no such view)."""
        out = []
        for pool in (self.keys, self.values):
            P, S, H, D = pool.shape
            out.append(pool.as_strided((rows, tokens, H, D), (stride * S * H * D, H * D, D, 1),
                                       pool.storage_offset() + base * S * H * D))
        return out[0], out[1]

    def kernel_operands(self) -> dict:
        return {"k_pool": self.keys, "v_pool": self.values, "k_scale": None, "v_scale": None, "kv_format": "float"}

    def page_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (self.keys, self.values))

    def residual_bytes(self) -> int:
        return 0  # a float page is its own full-precision copy

    def forget_residuals(self, pages: Collection[int]) -> None:
        pass


@torch.library.custom_op("hf_paged::write_slots", mutates_args=("keys", "values"))
def write_slots(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, new_keys: torch.Tensor,
                new_values: torch.Tensor) -> None:
    """Token t's key and value ``new_keys [T, H, D]`` go to slot ``slots[t]`` of the float pages ``keys``/``values``
    ``[P, S, H, D]`` (a custom op: a compiled graph mutates the pools in place instead of copying them)."""
    keys.view(-1, *keys.shape[2:]).index_copy_(0, slots, new_keys.to(keys.dtype))
    values.view(-1, *values.shape[2:]).index_copy_(0, slots, new_values.to(values.dtype))


@write_slots.register_fake
def _(keys, values, slots, new_keys, new_values) -> None:
    return None


def make_layer_pages(kv_format: str, page_size: int, heads: int, head_dim: int, value_dim: int, dtype: torch.dtype,
                     device: torch.device) -> FloatPages | QuantizedPages:
    """Empty pages of one layer in ``kv_format`` (checked first with `check_kv_format`; keys and values read
    back in ``dtype``)."""
    check_kv_format(kv_format, device, head_dim, value_dim)
    fmt = page_format(kv_format)
    if not fmt.quantized:
        return FloatPages(page_size, heads, head_dim, value_dim, dtype, device)
    return QuantizedPages(fmt, page_size, heads, head_dim, value_dim, dtype, device)


class PageStore:
    """The pages of every layer that shares one block manager's page ids (a layer group, or a whole
    `RaggedCache`), in one format. A layer's pages are made on its first write, on the device and dtype
    of its first keys (so ``device_map`` puts each layer's pages on its device); forks share the store.

    Invariant: every layer's pages are grown to the manager's ``num_pages`` before a step writes them; a write
    drops the residuals (int4's float keys of partial pages; a two-tier layer's rows) of the ``manager``'s free pages
    (a row that ended, or was cropped or rolled back, left them), so they are held for live pages only: once per
    layer after pages were freed (the manager's ``frees`` changed), not at every step.
    """

    def __init__(self, page_size: int, kv_format: str = "float", manager=None):
        self.page_size, self.kv_format, self.manager = page_size, kv_format, manager
        self.layers: dict[int, FloatPages] = {}
        self._frees_seen: dict[int, int] = {}  # id of a layer's pages -> the manager's ``frees`` it last dropped

    def layer(self, layer_idx: int) -> FloatPages | None:
        return self.layers.get(layer_idx)

    def create(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> FloatPages:
        """The pages of ``layer_idx`` for keys/values shaped ``[.., heads, tokens, dim]``, made if new."""
        pages = self.layers.get(layer_idx)
        if pages is None:
            tiers = getattr(self.manager, "cold", None)  # a byte budget with a cold format: `hf_paged.demotion`
            make = make_layer_pages if tiers is None else lambda *a: tiers.make_layer(layer_idx, *a[1:])
            pages = make(self.kv_format, self.page_size, keys.shape[1], keys.shape[3], values.shape[3], keys.dtype,
                         keys.device)
            self.layers[layer_idx] = pages
        return pages

    def write(self, pages: FloatPages, num_pages: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              copy_src: torch.Tensor | None = None, copy_dst: torch.Tensor | None = None) -> None:
        """A step of one layer: grow to the manager's ``num_pages``, copy ``copy_src`` onto ``copy_dst``
        (copy-on-write, before any write), then write the tokens ``[T, H, D]`` into ``slots``."""
        if copy_src is not None or pages.num_pages < num_pages:
            self.prepare(pages, num_pages, copy_src, copy_dst)
        if self.manager is not None and self._frees_seen.get(id(pages)) != self.manager.frees:
            pages.forget_residuals(self.manager.free)
            self._frees_seen[id(pages)] = self.manager.frees
        pages.write(slots, keys, values)

    @staticmethod
    def prepare(pages: FloatPages, num_pages: int, copy_src: torch.Tensor | None = None,
                copy_dst: torch.Tensor | None = None) -> None:
        """What a step does to a layer's pages before writing its tokens: grow, then copy on write."""
        pages.grow_to(num_pages)
        if copy_src is not None:
            pages.copy_pages(copy_src, copy_dst)

    # ------------------------------------------------ pages outside the pool (a prefix store's entries)
    def page_specs(self, layers: list[int], dims: tuple[int, int, int] | None = None, dtype: torch.dtype | None = None,
                   device: torch.device | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What one page of ``layers`` holds, as named tensors: each tensor of the format (``k_pool``, ``v_pool``,
        and the scales of a quantized one) stacked over the layers, ``(len(layers), *shape)``, when every layer has
        the same ones (else one per layer, ``"name.layer"``). A layer without pages is described as `make_layers`
        would make it from ``dims`` (kv heads, key and value head dims), ``dtype`` and ``device``."""
        per_layer = []
        for i in layers:
            pages = self.layers.get(i) or make_layer_pages(self.kv_format, self.page_size, *dims, dtype, device)
            per_layer.append({n: (tuple(t.shape[1:]), t.dtype) for n, t in _stored_tensors(pages).items()})
        if all(specs == per_layer[0] for specs in per_layer):
            return {n: ((len(layers), *shape), dt) for n, (shape, dt) in per_layer[0].items()}
        return {f"{n}.{i}": spec for i, specs in zip(layers, per_layer) for n, spec in specs.items()}

    def make_layers(self, layers: list[int], dims: tuple[int, int, int], dtype: torch.dtype,
                    device: torch.device) -> None:
        """Empty pages for the ``layers`` that have none yet (keys/values of ``dims`` in ``dtype`` on ``device``)."""
        for i in layers:
            if i not in self.layers:
                self.layers[i] = make_layer_pages(self.kv_format, self.page_size, *dims, dtype, device)

    def read_pages(self, pages: torch.Tensor, layers: list[int]) -> dict[str, torch.Tensor]:
        """CPU copies of ``pages [P]`` of ``layers`` as stored, named as `page_specs` names them, ``[P, *shape]``."""
        stacked = "." not in next(iter(self.page_specs(layers)))
        out: dict[str, list[torch.Tensor]] = {}
        for i in layers:
            for name, tensor in _stored_tensors(self.layers[i]).items():
                out.setdefault(name if stacked else f"{name}.{i}", []).append(tensor[pages.to(tensor.device)].cpu())
        return {name: torch.stack(parts, dim=1) if stacked else parts[0] for name, parts in out.items()}

    def write_pages(self, pages: torch.Tensor, layers: list[int], tensors: dict[str, torch.Tensor],
                    num_pages: int) -> None:
        """Write ``tensors`` (as `read_pages` returns them) into ``pages [P]`` of ``layers``, bytes as they are, after
        growing them to the manager's ``num_pages`` (once: growing page by page would copy the pool every time)."""
        stacked = all("." not in name for name in tensors)
        for j, i in enumerate(layers):
            layer = self.layers[i]
            layer.grow_to(num_pages)
            for name, tensor in _stored_tensors(layer).items():
                source = tensors[name][:, j] if stacked else tensors[f"{name}.{i}"]
                tensor[pages.to(tensor.device)] = source.to(tensor.device)
            layer.forget_residuals(set(pages.tolist()))

    def page_bytes(self) -> int:
        """Bytes of one page summed over the layers (0 before the first write)."""
        return sum(pages.page_bytes() for pages in self.layers.values())

    def residual_bytes(self) -> int:
        """Bytes of the float copies every layer keeps of its partial pages (int4's keys; 0 for other formats)."""
        return sum(pages.residual_bytes() for pages in self.layers.values())

    def held_bytes(self) -> int:
        """Bytes of the manager's used + cached pages in every layer (scales and residuals included)."""
        held = self.manager.num_used + len(self.manager.cached)
        return sum(pages.held_bytes(held) if hasattr(pages, "held_bytes") else held * pages.page_bytes()
                   for pages in self.layers.values()) + self.residual_bytes()

    def pool_bytes(self) -> int:
        """Bytes allocated for every layer's pages (and residual copies)."""
        return sum(pages.pool_bytes() if hasattr(pages, "pool_bytes") else
                   pages.page_bytes() * pages.num_pages + _residual_pool_bytes(pages) for pages in self.layers.values())


def _residual_pool_bytes(pages: FloatPages | QuantizedPages) -> int:
    residual = getattr(pages, "k_residual", None)
    return 0 if residual is None else residual.numel() * residual.element_size()


def _stored_tensors(pages: FloatPages | QuantizedPages) -> dict[str, torch.Tensor]:
    """A layer's page tensors (``[num_pages, ...]``: the format's bytes, scales included), by kernel operand name."""
    return {name: t for name, t in pages.kernel_operands().items() if torch.is_tensor(t)}
