"""One stored entry: the pages of one run of a sequence, all layers, as a self-describing safetensors blob.

The safetensors metadata names the store format, the namespace, the page format and layout version, the
run's first page index and the chained hashes of its pages (the key is the last one), and a CRC-32 of
the data section (all tensor bytes). `decode_entry` returns tensors only when every one of these matches
what the reader asked for and the layout it expects; anything else raises `BadEntry`. The checksum
detects damage (truncation, flipped bits), not tampering: who may write entries is settled by the
folder's permissions or by who may reach the Redis server.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from .errors import BadEntry
from .layout import STORE_FORMAT, PageLayout

MAGIC_KEY = "hf_paged.prefix_store"


def _metadata(layout: PageLayout, first: int, hashes: Sequence[bytes]) -> dict[str, str]:
    return {MAGIC_KEY: str(STORE_FORMAT), "namespace": layout.namespace, "page_format": layout.page_format,
            "layout_version": str(layout.layout_version), "first": str(first),
            "pages": ",".join(h.hex() for h in hashes)}


def _header(data: bytes) -> tuple[dict, int]:
    """The safetensors header of ``data`` and where its data section starts; `BadEntry` if unreadable."""
    if len(data) < 8:
        raise BadEntry(f"{len(data)} bytes is too short for a safetensors header")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise BadEntry(f"its header claims {size} bytes but only {len(data) - 8} follow (truncated)")
    try:
        header = json.loads(data[8:8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadEntry(f"its header is not valid JSON ({error})") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise BadEntry("its header has no metadata")
    return header, 8 + size


def encode_entry(layout: PageLayout, first: int, hashes: Sequence[bytes], tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The bytes of an entry holding pages ``first .. first + len(hashes) - 1`` (``tensors`` checked by the caller).

    safetensors lays the tensors out; the CRC-32 of that data section is then added to the header's
    metadata (the offsets in the header are relative to the data section, so they stay valid).
    """
    blob = save({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()},
                metadata=_metadata(layout, first, hashes))
    header, start = _header(blob)
    data = memoryview(blob)[start:]
    header["__metadata__"]["crc32"] = f"{zlib.crc32(data):08x}"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header to a multiple of 8 bytes
    return struct.pack("<Q", len(text)) + text + data


def entry_metadata(data: bytes) -> dict[str, str]:
    """The safetensors metadata of ``data``; raises `BadEntry` when there is no readable header."""
    return _header(data)[0]["__metadata__"]


def decode_entry(layout: PageLayout, first: int, hashes: Sequence[bytes], data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of the entry ``data``, verified to hold pages ``first ..`` with ``hashes`` in ``layout``."""
    header, start = _header(data)
    metadata = header["__metadata__"]
    for field, value in _metadata(layout, first, hashes).items():
        if metadata.get(field) != value:
            raise BadEntry(f"its {field} is {metadata.get(field)!r}, expected {value!r} (a foreign entry)")
    if metadata.get("crc32") != f"{zlib.crc32(memoryview(data)[start:]):08x}":
        raise BadEntry("its checksum does not match its data (corrupt or truncated)")
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise BadEntry(f"its tensors cannot be read ({error})") from None
    try:
        layout.check(tensors, len(hashes))
    except ValueError as error:
        raise BadEntry(f"its tensors do not fit the layout: {error}") from None
    return tensors
