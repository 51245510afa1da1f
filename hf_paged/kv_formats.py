"""Page formats: how one layer's keys and values are stored in its pages, and read back.

A format is a pair of codecs (keys, values). Most codecs work per token: a token's vector of one KV head is
encoded on its own, when it is written, with its scales beside it in the same slot, so a write never changes
another token's bytes and a NaN or inf in one token cannot reach another token's scales. int4's (and int2's)
keys are encoded per channel within a page (`PageChannelCodec`, KIVI's keys): a page's codes depend on all its
tokens, so the page being filled keeps a float copy of its keys (its residual) and is encoded again from it at
every write, a last time when it fills (`QuantizedPages`).

* ``"float"``: the model's dtype, unchanged (`hf_paged.page_store.FloatPages`).
* ``"int8"``: symmetric, one float16 scale per token and KV head: ``x = scale * code``, codes in [-127, 127].
* ``"int4"``: two codes a byte. Keys: ``x = low + step * code`` per page, KV head and channel (a float16
  minimum, a float8 e4m3 step), codes in [0, 15]. Values: per token, one asymmetric group a head with a
  float16 scale and an int8 zero point, ``x = scale * (code - zero)``, stored rotated by a fixed orthogonal
  block-Hadamard matrix (`rotation`; a kernel rotates its output back: R is its own inverse).
* ``"int2"``: int4's scheme at 2 bits (codes in [0, 3], four a byte; the same float16 / float8 parameters and
  zero points), lossy as 2 bits are: cold pages under a budget are what it is for (``cold_format="int2"``).
* ``"fp8_e4m3"`` (CUDA, the Triton kernel): float8 e4m3 scaled into its range per token and KV head.

Why these: ``scripts/quantized.py`` measures perplexity (2048 tokens of the embedded text, paired 95% bootstrap
intervals) and bytes of each choice on the embedded SmolLM2: int8 -0.03% [-0.17, +0.10] at 0.258x float32's
bytes. For int4, keys carry the error (values alone: KL about 0.006); per-token keys (groups of 16, rotated)
measured +1.99% [+0.81, +3.24] at 0.154x, their variants (not rotated, groups of 32 or one a head) +2.4 to
+3.8%. Keys per channel within pages of 16 measured +1.00% (KL 0.0137) with a float16 minimum and step
(0.162x), +1.58% (KL 0.0150) with a float16 step and an int8 zero point (0.154x: a channel far from zero gets
a coarse step), +0.56% [-0.24, +1.48] (KL 0.0152) with a float16 minimum and a float8 step rounded up (0.154x):
the format. Its bytes depend on the page size (the parameters are per page): 0.154x in pages of 16, 0.22x in
pages of 4.

Non-finite inputs: per-token scales come from a group's finite entries and +-inf saturate to the extreme codes;
a group holding a NaN, or nothing finite, gets a NaN scale and reads back as NaN (as a float page would hold
it), while every other group and token keeps its own scales. (A rotated row with an inf is inf throughout
its rotation block, so it reads back as NaN.) int4 keys: a channel's range within a page comes from its finite
entries; +inf reads back as its top, -inf and NaN as its bottom, a channel with nothing finite as 0.

Layout of a quantized layer's tensors (``P`` pages of ``S`` slots, ``H`` KV heads, head dim ``D``):

* codes ``[P, S, H, W]``: int8 (``W = D``), float8_e4m3fn (``W = D``) or uint8 for int4 (byte ``j < D / 2``
  holds element ``2j`` in its low and ``2j + 1`` in its high nibble; values: ``W = D / 2 + 1``, byte ``D / 2``
  the int8 zero point; keys: ``W = D / 2``) and int2 (byte ``j < D / 4`` holds element ``4j + i`` in its bits
  ``2i, 2i + 1``; ``W = D / 4 + 1`` and ``D / 4``);
* scales ``[P, S, H, 1]`` float16 (one group a token and head); int4 keys: a page's parameters ``[P, H, D + D / 2]``
  float16, the D minima, then the D float8 steps' bytes two to a float16 slot.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from .errors import CacheUsageError
from .kernels import cpu_page_codecs

__all__ = ["KV_FORMATS", "KEY_GROUP", "PageChannelCodec", "PageFormat", "QuantizedPages", "check_kv_format",
           "page_format", "rotation",
           "quantize", "dequantize"]

KEY_GROUP = 16  # elements of a key group of per-token int4 keys (`PackedCodec`: what the study compares int4 with)
_FP16_MAX = 65504.0
_FP8_MAX = 448.0  # largest float8_e4m3fn
_FP8_MAX_BITS = 0x7E  # its bits (0x7F is NaN)


# ------------------------------------------------------------------------------------------ codecs
@functools.lru_cache(maxsize=None)
def _rotation(dim: int, device: torch.device) -> torch.Tensor:
    block = dim & -dim  # the largest power of two dividing dim
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < block:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)])
    matrix = torch.block_diag(*[hadamard / math.sqrt(block)] * (dim // block))
    return matrix.to(torch.float32).to(device)


def rotation(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed ``[dim, dim]`` float32 rotation of rotated codecs: block-diagonal Sylvester Hadamard blocks
    (the largest power of two dividing ``dim``), scaled to be orthogonal. Symmetric, so ``R @ R = I``:
    ``x @ R`` rotates a row vector and ``y @ R`` rotates it back; exact and the same on every machine."""
    return _rotation(dim, torch.device(device))


def _finite_range(groups: torch.Tensor, reduce: str, finite: bool) -> torch.Tensor:
    """Per group (last dim) the min or max of the finite entries; 0 for a group without any (``finite``: every
    entry is finite, nothing to skip)."""
    if finite:
        return getattr(groups, reduce)(-1)
    fill = math.inf if reduce == "amin" else -math.inf
    out = getattr(torch.where(torch.isfinite(groups), groups, fill), reduce)(-1)
    return torch.where(torch.isfinite(out), out, 0.0)


def _scale(value: torch.Tensor, groups: torch.Tensor, finite: bool) -> torch.Tensor:
    """float16 scales (clamped into float16's range), NaN for the groups (last dim of ``groups``) that hold a
    NaN or nothing finite (none when ``finite``)."""
    value = value.clamp(max=_FP16_MAX)
    if not finite:
        value = value.masked_fill(groups.isnan().any(-1) | ~torch.isfinite(groups).any(-1), float("nan"))
    return value.to(torch.float16)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., D]`` of ``bits`` bits (4 or 2) packed ``8 / bits`` a byte, ``[..., D * bits / 8]``: byte j
    holds element ``j * 8 / bits + i`` in its bits ``[i * bits, (i + 1) * bits)`` (low bits first)."""
    per = 8 // bits
    grouped = codes.unflatten(-1, (-1, per))
    packed = grouped[..., 0]
    for i in range(1, per):
        packed = packed | (grouped[..., i] << (bits * i))
    return packed


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes `_pack` packed into ``packed [..., W]``, as float32 ``[..., W * 8 / bits]``."""
    mask = (1 << bits) - 1
    return torch.stack([(packed >> (bits * i)) & mask for i in range(8 // bits)], -1).flatten(-2).float()


@dataclass(frozen=True)
class SymmetricCodec:
    """``x = scale * code`` per token and head, codes of ``dtype`` up to ``limit`` in magnitude (int8, fp8)."""

    dtype: torch.dtype
    limit: float
    rotated: bool = False

    def group_size(self, dim: int) -> int:
        return dim

    def groups(self, dim: int) -> int:
        return 1

    def width(self, dim: int) -> int:
        return dim

    def encode(self, x: torch.Tensor, finite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``[..., D]`` -> (codes ``[..., D]``, float16 scales ``[..., 1]``); ``finite``: the caller checked
        that every entry is (the steps that keep non-finite entries out are skipped)."""
        magnitude = x.abs() if finite else x.abs().where(torch.isfinite(x), 0.0)
        scale = _scale(magnitude.amax(-1) / self.limit, x, finite)[..., None]
        s = scale.float()
        scaled = torch.where(s > 0, x / s, 0.0)
        scaled = (scaled if finite else scaled.nan_to_num(0.0)).clamp(-self.limit, self.limit)
        return (scaled.round() if not self.dtype.is_floating_point else scaled).to(self.dtype), scale

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, dim: int) -> torch.Tensor:
        return codes.float() * scale.float()


@dataclass(frozen=True)
class PackedCodec:
    """``bits``-bit codes (4: two a byte; 2: four a byte, `_pack`), ``x = scale * (code - zero)`` per group of
    ``group`` elements (None: the whole head), an int8 zero point per group stored after the codes (module
    docstring)."""

    group: int | None
    rotated: bool = True
    bits: int = 4
    dtype = torch.uint8

    def group_size(self, dim: int) -> int:
        return dim if self.group is None else math.gcd(dim, self.group)

    def groups(self, dim: int) -> int:
        return dim // self.group_size(dim)

    def width(self, dim: int) -> int:
        return dim * self.bits // 8 + self.groups(dim)

    def encode(self, x: torch.Tensor, finite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``[..., D]`` (D a multiple of 8 / bits) -> (uint8 ``[..., D * bits / 8 + G]``, float16 scales
        ``[..., G]``); ``finite`` as for `SymmetricCodec.encode`."""
        dim, top = x.shape[-1], (1 << self.bits) - 1
        groups = x.unflatten(-1, (self.groups(dim), self.group_size(dim)))
        low, high = _finite_range(groups, "amin", finite), _finite_range(groups, "amax", finite)
        # wide enough for the range, and for the zero point -low / scale to fit an int8 (|zero| <= 120)
        scale = _scale(torch.maximum((high - low) / top, low.abs() / 120), groups, finite)
        s = (scale.float() if finite else scale.float().nan_to_num(0.0))[..., None]
        zero = torch.where(s > 0, -low[..., None] / s, 0.0).round().clamp(-128, 127)
        scaled = torch.where(s > 0, groups / s, 0.0)
        codes = (scaled if finite else scaled.nan_to_num(0.0)).add(zero).round().clamp(0, top).to(torch.uint8)
        packed = _pack(codes.flatten(-2), self.bits)
        return torch.cat([packed, zero[..., 0].to(torch.int8).view(torch.uint8)], -1), scale

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, dim: int) -> torch.Tensor:
        packed = dim * self.bits // 8
        zero = codes[..., packed:].view(torch.int8).float()
        values = _unpack(codes[..., :packed], self.bits)
        values = (values.unflatten(-1, (zero.shape[-1], -1)) - zero[..., None]) * scale.float()[..., None]
        return values.flatten(-2)


@dataclass(frozen=True)
class PageChannelCodec:
    """KIVI's keys: ``bits``-bit codes per channel within a page, ``x = low + step * code`` (codes in [0, 15], or
    [0, 3] for 2 bits) with a float16 ``low`` and a float8_e4m3fn ``step`` per page, KV head and channel (the step
    rounded up, so a channel's range always fits). Packed as `PackedCodec` packs them (`_pack`); a page's parameters
    ``[H, D + D / 2]`` float16: the D minima, then the D steps' bytes two to a float16 slot.

    Encoded over a whole page (`encode_pages`), never a token alone: a page's codes depend on every token it
    holds. Non-finite entries are left out of their channel's range (+inf reads back as its top, -inf and NaN
    as its bottom), so they never reach the other tokens' codes; a channel with nothing finite reads 0.
    """

    bits: int = 4
    rotated = False
    dtype = torch.uint8
    per_page = True

    def width(self, dim: int) -> int:
        return dim * self.bits // 8

    def group_size(self, dim: int) -> int:
        return 1  # a step and a minimum per channel

    def params_width(self, dim: int) -> int:
        return dim + dim // 2

    def encode_pages(self, x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``x [U, S, H, D]`` of U pages, ``valid [U, S]`` the slots holding tokens -> (codes uint8
        ``[U, S, H, D * bits / 8]``, parameters float16 ``[U, H, D + D / 2]``); every page's slot 0 must be valid (a
        page holds its first tokens), slots not valid get codes of no meaning."""
        x = torch.where(valid[:, :, None, None], x, x[:, :1])  # slot 0 holds a token: no other range
        if bool(torch.isfinite(x).all()):
            low, high = x.amin(1), x.amax(1)
        else:
            keep = torch.isfinite(x)
            low = torch.where(keep, x, math.inf).amin(1)
            high = torch.where(keep, x, -math.inf).amax(1)
            empty = ~keep.any(1)
            low, high = torch.where(empty, 0.0, low), torch.where(empty, 0.0, high)
        low16 = low.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
        top = (1 << self.bits) - 1
        need = ((high - low16.float()) / top).clamp(0.0, _FP8_MAX)
        bits = need.to(torch.float8_e4m3fn).view(torch.uint8)  # round to nearest, then up where that is short
        bits = torch.where((bits.view(torch.float8_e4m3fn).float() < need) & (bits < _FP8_MAX_BITS), bits + 1, bits)
        step = bits.view(torch.float8_e4m3fn).float()
        scaled = torch.where(step[:, None] > 0, (x - low16.float()[:, None]) / step[:, None], 0.0)
        codes = scaled.nan_to_num(0.0, float(top), 0.0).round().clamp(0, top).to(torch.uint8)
        return _pack(codes, self.bits), torch.cat([low16, bits.contiguous().view(torch.float16)], -1)

    def decode_pages(self, codes: torch.Tensor, params: torch.Tensor, dim: int) -> torch.Tensor:
        """float32 ``[..., S, H, dim]`` of pages' codes ``[..., S, H, dim * bits / 8]`` and parameters
        ``[..., H, 3 dim / 2]``."""
        low = params[..., :dim].float()
        step = params[..., dim:].contiguous().view(torch.uint8).view(torch.float8_e4m3fn).float()
        return _unpack(codes, self.bits) * step.unsqueeze(-3) + low.unsqueeze(-3)


@dataclass(frozen=True)
class PageFormat:
    """A page format: the codecs of keys and values (None: float), and the device types it can be read on."""

    name: str
    key: SymmetricCodec | PackedCodec | PageChannelCodec | None
    value: SymmetricCodec | PackedCodec | None
    devices: tuple[str, ...] | None  # None: any
    packing: int = 1  # values a byte: head dims must be multiples of it

    @property
    def quantized(self) -> bool:
        return self.key is not None


_FORMATS = {
    "float": PageFormat("float", None, None, None),
    "int8": PageFormat("int8", SymmetricCodec(torch.int8, 127.0), SymmetricCodec(torch.int8, 127.0), ("cpu", "cuda")),
    "int4": PageFormat("int4", PageChannelCodec(), PackedCodec(None), ("cpu", "cuda"), packing=2),
    "int2": PageFormat("int2", PageChannelCodec(bits=2), PackedCodec(None, bits=2), ("cpu", "cuda"), packing=4),
    "fp8_e4m3": PageFormat("fp8_e4m3", SymmetricCodec(torch.float8_e4m3fn, _FP8_MAX),
                           SymmetricCodec(torch.float8_e4m3fn, _FP8_MAX), ("cuda",)),
}
KV_FORMATS = tuple(_FORMATS)


def _unknown(kv_format) -> CacheUsageError:
    return CacheUsageError(f"kv_format={kv_format!r} is not a page format; choose one of "
                           f"{', '.join(map(repr, KV_FORMATS))}")


def page_format(kv_format: str) -> PageFormat:
    """The `PageFormat` named ``kv_format`` (CacheUsageError naming the alternatives if there is none)."""
    if not isinstance(kv_format, str) or kv_format not in _FORMATS:
        raise _unknown(kv_format)
    return _FORMATS[kv_format]


def check_kv_format(kv_format: str, device: torch.device | str | None = None, head_dim: int | None = None,
                    value_dim: int | None = None, argument: str = "kv_format") -> None:
    """Raise `CacheUsageError` (naming the argument and the alternatives) unless pages of ``kv_format`` can be
    stored for these head dims and read on ``device``: an unknown format, fp8 off CUDA (the CPU kernel reads
    float, int8, int4 and int2; Triton reads fp8 from compute capability 8.9), a head dim that int4 (odd) or int2
    (not a multiple of 4) cannot pack. What is not known yet (None) is not checked; ``argument``: the name the
    error gives the format (``cold_format`` for a cold tier's)."""
    fmt = page_format(kv_format)
    if device is not None:
        _check_device(kv_format, torch.device(device))
    dims = {"head_dim": head_dim, "value_dim": head_dim if value_dim is None else value_dim}
    for name, dim in dims.items():
        if dim is not None and dim % fmt.packing:
            fits = [n for n, f in _FORMATS.items() if dim % f.packing == 0 and n != "fp8_e4m3"]
            raise CacheUsageError(f"{argument}={kv_format!r} packs {fmt.packing} values a byte and needs a {name} "
                                  f"divisible by {fmt.packing}, the model's is {dim}; choose one of "
                                  f"{', '.join(map(repr, fits))}")


def _check_device(kv_format: str, device: torch.device) -> None:
    readable = [name for name, f in _FORMATS.items() if f.devices is None or device.type in f.devices]
    if kv_format not in readable:
        raise CacheUsageError(f"kv_format={kv_format!r} cannot be read on {device.type} (only the Triton kernel "
                              f"on CUDA reads it); on {device.type} choose one of {', '.join(map(repr, readable))}")
    if kv_format == "fp8_e4m3" and torch.cuda.get_device_capability(device) < (8, 9):
        raise CacheUsageError(f"kv_format='fp8_e4m3' needs a GPU of compute capability 8.9 or newer, {device} has "
                              f"{torch.cuda.get_device_capability(device)}; choose 'int8' or 'int4'")


def dequantize(codec: SymmetricCodec | PackedCodec | PageChannelCodec, codes: torch.Tensor, scale: torch.Tensor,
               dim: int) -> torch.Tensor:
    """float32 ``[..., dim]`` values of ``codes``/``scale`` in the model's basis (a rotated codec's rotation
    undone; a per-page codec's ``codes [..., S, H, W]`` with their pages' parameters ``scale [..., H, W']``)."""
    if getattr(codec, "per_page", False):
        return codec.decode_pages(codes, scale, dim)
    values = codec.decode(codes, scale, dim)
    return values @ rotation(dim, values.device) if codec.rotated else values


def slot_scale_strides(codec: SymmetricCodec | PackedCodec | PageChannelCodec, scale: torch.Tensor) -> tuple[int, ...]:
    """Element strides (page, slot, head) by which a kernel finds a slot's scales in ``scale``: a per-page codec's
    parameters ``[P, H, W']`` are every slot's of their page (slot stride 0)."""
    if getattr(codec, "per_page", False):
        return scale.stride(0), 0, scale.stride(1)
    return tuple(scale.stride()[:3])


def quantize(codec: SymmetricCodec | PackedCodec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, float16 scales) of ``x [..., dim]`` (any float dtype), rotated first by a rotated codec: what a
    page stores; `dequantize` reads it back."""
    x = encoding_basis(codec, x)
    return codec.encode(x, finite=bool(torch.isfinite(x).all()))


def encoding_basis(codec: SymmetricCodec | PackedCodec, x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 in the basis ``codec`` encodes: rotated by a rotated codec (`rotation`)."""
    x = x.float()
    return x @ rotation(x.shape[-1], x.device) if codec.rotated else x


# ----------------------------------------------------------------------------------- layer pages
class QuantizedPages:
    """A layer's pages in a quantized `PageFormat`: codes and float16 scales of keys and values (layout in
    the module docstring); reads dequantize to ``dtype``.

    Keys of a per-page codec (int4's, `PageChannelCodec`) are encoded over their page: a page's parameters
    ``k_scale [P, H, W']`` and the codes of all its tokens are made again at every write into it, from a float
    copy of its keys in ``dtype`` (the residual, `residual_bytes`) that the page keeps while it is partial.
    The write that fills a page encodes it a last time; a full page is then stored only as codes. A page filled
    by one write needs no residual; one that held tokens before the write that filled it keeps its residual
    until the layer's next write that leaves it alone, so the retry of a rolled-back step (or a write after
    a crop back into it) re-encodes it from the exact keys, as if the step had never run. A write into a
    page holding tokens but no residual (a crop further back, into a page filled earlier; a page copied in
    from a prefix store) starts the page's residual from what the page hands back (its decoded keys): those
    tokens are then quantized a second time, from values already on their first grid.
    A write's slots of one page are the page's last tokens (a row writes its positions in order from the
    first slot of a page), so the slots before a write's last one in each page hold its tokens.

    Invariants: the four tensors always have the same number of pages; a slot's codes and scales are written,
    copied and grown together, so they always encode the same token (a per-page codec's codes, parameters
    and residual: the same page); pages never written decode to zeros.
    """

    def __init__(self, fmt: PageFormat, page_size: int, heads: int, head_dim: int, value_dim: int,
                 dtype: torch.dtype, device):
        self.format, self.kv_format = fmt, fmt.name
        self.page_size, self.dtype, self.device = page_size, dtype, torch.device(device)
        self.head_dim, self.value_dim = head_dim, value_dim
        shapes = {"k": (fmt.key, head_dim), "v": (fmt.value, value_dim)}
        for name, (codec, dim) in shapes.items():
            setattr(self, f"{name}_codes", torch.zeros(0, page_size, heads, codec.width(dim), dtype=codec.dtype,
                                                       device=self.device))
            scale = ((0, heads, codec.params_width(dim)) if getattr(codec, "per_page", False)
                     else (0, page_size, heads, codec.groups(dim)))
            setattr(self, f"{name}_scale", torch.zeros(scale, dtype=torch.float16, device=self.device))
        self.k_residual = torch.zeros(0, page_size, heads, head_dim, dtype=dtype, device=self.device)
        self._residual_row: dict[int, int] = {}  # page -> its row of k_residual (partial pages of a per-page codec)
        self._free_rows: list[int] = []
        self._just_filled: set[int] = set()  # pages the last write filled that keep their residual until the next

    _TENSORS = ("k_codes", "k_scale", "v_codes", "v_scale")

    @property
    def num_pages(self) -> int:
        return self.k_codes.shape[0]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(heads, head_dim, value_dim, page_size): what every write must match."""
        return self.k_codes.shape[2], self.head_dim, self.value_dim, self.page_size

    def grow_to(self, num_pages: int) -> None:
        if num_pages > self.num_pages:
            for name in self._TENSORS:
                setattr(self, name, _grown(getattr(self, name), num_pages))

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Encode ``keys [T, H, D]``/``values [T, H, Dv]`` into the flat slots ``slots [T]`` (page * S + slot)."""
        fmt, heads = self.format, keys.shape[1]
        if getattr(fmt.key, "per_page", False):
            self._write_page_keys(slots, keys)
            encoded = () if self._values_in_c(slots, values) else (("v", *quantize(fmt.value, values)),)
        elif fmt.key == fmt.value and self.head_dim == self.value_dim:  # one codec: keys and values in one call
            codes, scale = quantize(fmt.key, torch.cat([keys, values], 1))
            encoded = (("k", codes[:, :heads], scale[:, :heads]), ("v", codes[:, heads:], scale[:, heads:]))
        else:
            encoded = (("k", *quantize(fmt.key, keys)), ("v", *quantize(fmt.value, values)))
        for prefix, codes, scale in encoded:
            getattr(self, f"{prefix}_codes").flatten(0, 1)[slots] = codes
            getattr(self, f"{prefix}_scale").flatten(0, 1)[slots] = scale

    def _write_page_keys(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Per-page keys: each page written gets its residual (or, holding tokens without one, its decoded keys)
        with the new keys in their slots, and is encoded again over the slots up to the write's last one."""
        S = self.page_size
        slot_list = slots.tolist()
        if not slot_list:
            return
        spans: dict[int, list[int]] = {}  # page -> [first slot written, last slot written + 1]
        for slot in slot_list:
            page, offset = divmod(slot, S)
            span = spans.setdefault(page, [offset, offset + 1])
            span[0], span[1] = min(span[0], offset), max(span[1], offset + 1)
        page_list = list(spans)
        self.forget_residuals(self._just_filled.difference(page_list))
        buffer = None if self._page_keys_in_c(spans, slot_list, keys) else self._page_keys_in_torch(spans, slots, keys)
        keep = [i for i, page in enumerate(page_list) if spans[page][1] < S or spans[page][0] > 0]
        self._just_filled = {page_list[i] for i in keep if spans[page_list[i]][1] == S}
        self.forget_residuals(set(page_list).difference(page_list[i] for i in keep))
        if keep and buffer is not None:
            rows = [self._residual_row_of(page_list[i]) for i in keep]  # first: it may grow k_residual
            self.k_residual[rows] = buffer[keep].to(self.dtype)

    def _page_keys_in_c(self, spans: dict[int, list[int]], slot_list: list[int], keys: torch.Tensor) -> bool:
        """`_write_page_keys` through the C encoder (`cpu_page_codecs`, bit-exact): for float32 keys on the CPU
        when every page written holds a residual or is written from its first slot. The new keys go into the
        pages' residuals (a fresh page's zeroed first), which are then encoded in place. -> False when it does
        not serve (nothing encoded; residuals it gave hold the new keys, as the torch path would make them)."""
        if not (self.device.type == "cpu" and self.dtype == keys.dtype == torch.float32
                and all(page in self._residual_row or span[0] == 0 for page, span in spans.items())
                and cpu_page_codecs.available()):
            return False
        S, fresh = self.page_size, [page for page in spans if page not in self._residual_row]
        rows = {page: self._residual_row_of(page) for page in spans}  # first: it may grow k_residual
        if fresh:
            self.k_residual[[rows[page] for page in fresh]] = 0.0
        targets = [rows[slot // S] * S + slot % S for slot in slot_list]
        return cpu_page_codecs.encode_page_keys(keys, targets, self.k_residual, list(rows.values()),
                                                [span[1] for span in spans.values()], list(spans), self.k_codes,
                                                self.k_scale)

    def _page_keys_in_torch(self, spans: dict[int, list[int]], slots: torch.Tensor,
                            keys: torch.Tensor) -> torch.Tensor:
        """`_write_page_keys` in torch: encodes the pages written; -> their float32 keys ``[U, S, H, D]``."""
        S, device, page_list = self.page_size, self.device, list(spans)
        index = {page: i for i, page in enumerate(page_list)}
        rows = [self._residual_row.get(page, -1) for page in page_list]
        pages = torch.tensor(page_list, device=device)
        buffer = torch.zeros(len(page_list), S, *keys.shape[1:], device=device)
        held = [i for i, row in enumerate(rows) if row >= 0]
        if held:
            buffer[held] = self.k_residual[[rows[i] for i in held]].float()
        stale = [i for i, (page, row) in enumerate(zip(page_list, rows)) if row < 0 and spans[page][0] > 0]
        if stale:
            buffer[stale] = self.format.key.decode_pages(self.k_codes[pages[stale]], self.k_scale[pages[stale]],
                                                         self.head_dim)
        buffer[torch.tensor([index[slot // S] for slot in slots.tolist()], device=device), slots % S] = keys.float()
        filled = torch.tensor([spans[page][1] for page in page_list], device=device)
        self.k_codes[pages], self.k_scale[pages] = self.format.key.encode_pages(
            buffer, torch.arange(S, device=device) < filled[:, None])
        return buffer

    def _values_in_c(self, slots: torch.Tensor, values: torch.Tensor) -> bool:
        """Values of `PackedCodec(None)` (4 or 2 bits) encoded by the C encoder (`cpu_page_codecs`, bit-exact) on the
        CPU, after the rotation in torch, as `quantize` does; -> False when it does not serve (nothing written)."""
        codec = self.format.value
        if not (self.device.type == "cpu" and codec in (PackedCodec(None), PackedCodec(None, bits=2))
                and cpu_page_codecs.available()):
            return False
        return cpu_page_codecs.encode_packed_values(encoding_basis(codec, values).contiguous(), slots, self.v_codes,
                                                  self.v_scale)

    def _residual_row_of(self, page: int) -> int:
        """The residual row of ``page``, given one if it has none (k_residual grows by doubling)."""
        if page not in self._residual_row:
            if not self._free_rows:
                have = self.k_residual.shape[0]
                self.k_residual = _grown(self.k_residual, max(4, 2 * have))
                self._free_rows = list(range(self.k_residual.shape[0] - 1, have - 1, -1))
            self._residual_row[page] = self._free_rows.pop()
        return self._residual_row[page]

    def forget_residuals(self, pages: Collection[int]) -> None:
        """Drop the residuals of ``pages`` (overwritten as stored, a prefix store's full pages; or free pages)."""
        for page in [p for p in self._residual_row if p in pages]:
            self._just_filled.discard(page)
            self._free_rows.append(self._residual_row.pop(page))

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for name in self._TENSORS:
            tensor = getattr(self, name)
            tensor[dst] = tensor[src]
        for s, d in zip(src.tolist(), dst.tolist()):  # a partial page's residual travels with its codes
            if s in self._residual_row:
                row = self._residual_row_of(d)  # first: it may grow k_residual
                self.k_residual[row] = self.k_residual[self._residual_row[s]]
                if s in self._just_filled:
                    self._just_filled.add(d)
            else:
                self.forget_residuals((d,))

    def gather(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[..., S, H, D]`` and values ``[..., S, H, Dv]`` of ``pages [...]``, dequantized to ``dtype``
        (only these pages are decoded)."""
        keys = dequantize(self.format.key, self.k_codes[pages], self.k_scale[pages], self.head_dim)
        values = dequantize(self.format.value, self.v_codes[pages], self.v_scale[pages], self.value_dim)
        return keys.to(self.dtype), values.to(self.dtype)

    def kernel_operands(self) -> dict:
        return dict(k_pool=self.k_codes, v_pool=self.v_codes, k_scale=self.k_scale, v_scale=self.v_scale,
                    kv_format=self.kv_format)

    def page_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (getattr(self, n) for n in self._TENSORS))

    def residual_bytes(self) -> int:
        """Bytes of the float keys held for partial pages (a per-page codec's; 0 otherwise)."""
        return len(self._residual_row) * self.k_residual[0:1].numel() * self.k_residual.element_size()


def _grown(tensor: torch.Tensor, num_pages: int) -> torch.Tensor:
    """``tensor`` with ``num_pages`` pages: its pages first, zeros after."""
    grown = tensor.new_zeros((num_pages, *tensor.shape[1:]))
    grown[: tensor.shape[0]] = tensor
    return grown
