"""Prefix store namespaces, page layouts and the entry format (safetensors, metadata, checksum)."""

import pytest
import torch
from prefix_store_cases import chain, layout, pages, same_pages

from hf_paged.prefix_store import PageLayout, store_namespace
from hf_paged.prefix_store.entry import decode_entry, encode_entry, entry_metadata
from hf_paged.prefix_store.errors import BadEntry
from hf_paged.prefix_store.layout import MAX_PAGES_PER_ENTRY

BASE = dict(model_fingerprint=b"\x01" * 32, dtype=torch.bfloat16, page_size=16, layer_windows=[None, 4096],
            device_type="cuda", page_format="kv", layout_version=1)


@pytest.mark.parametrize("field, other", [
    ("model_fingerprint", b"\x01" * 31 + b"\x02"), ("dtype", torch.float16), ("page_size", 32),
    ("layer_windows", [None, 2048]), ("layer_windows", [None, None]), ("device_type", "cpu"),
    ("page_format", "kv-int8"), ("layout_version", 2),
])
def test_every_field_changes_the_namespace(field, other):
    assert store_namespace(**BASE) == store_namespace(**BASE)
    assert store_namespace(**{**BASE, field: other}) != store_namespace(**BASE)


def test_dtype_as_string_or_torch_dtype_is_one_namespace():
    assert store_namespace(**{**BASE, "dtype": "bfloat16"}) == store_namespace(**BASE)


@pytest.mark.parametrize("field, bad", [("device_type", "cuda:1"), ("device_type", ""), ("model_fingerprint", b""),
                                        ("model_fingerprint", "text"), ("page_size", 0), ("page_format", ""),
                                        ("layout_version", "1")])
def test_bad_namespace_input_is_refused(field, bad):
    with pytest.raises(ValueError, match=field):
        store_namespace(**{**BASE, field: bad})


def test_pages_per_entry_reaches_half_a_megabyte():
    assert layout("run").page_bytes == 128 * 1024 and layout("run").pages_per_entry == 4
    assert layout("page").pages_per_entry == 1
    tiny = PageLayout("ns", "kv", 1, (layout("run").tensors[0].__class__("k", (1, 1, 2), torch.float16),))
    assert tiny.pages_per_entry == MAX_PAGES_PER_ENTRY
    assert [layout("run").entry_start(p) for p in range(6)] == [0, 0, 0, 0, 4, 4]


def test_layout_check_names_what_is_wrong():
    run = layout("run")
    good = pages(run, 2)
    run.check(good, 2)
    with pytest.raises(ValueError, match="tensors"):
        run.check({**good, "extra": good["k.0"]}, 2)
    with pytest.raises(ValueError, match="shape"):
        run.check(good, 3)
    with pytest.raises(ValueError, match="float16"):
        run.check({**good, "k.0": good["k.0"].half()}, 2)


@pytest.mark.parametrize("kind", ["run", "page", "quant"])
def test_entry_round_trip_is_bitwise(kind):
    lay = layout(kind)
    hashes = chain(3)
    tensors = pages(lay, 3)
    data = encode_entry(lay, 8, hashes, tensors)
    meta = entry_metadata(data)
    assert meta["namespace"] == lay.namespace and meta["page_format"] == f"kv-{kind}"
    assert meta["pages"].split(",")[-1] == hashes[-1].hex() and meta["first"] == "8"
    out = decode_entry(lay, 8, hashes, data)
    assert same_pages(out, tensors)
    assert {t.dtype for t in out.values()} == {spec.dtype for spec in lay.tensors}


def test_quantized_layout_keeps_integer_and_scale_tensors():
    lay = layout("quant")
    assert {spec.dtype for spec in lay.tensors} == {torch.int8, torch.uint8, torch.float32}
    tensors = pages(lay, 2)
    assert tensors["k.0"].min() < 0 and tensors["v.0"].max() > 127  # the full ranges survive
    assert same_pages(decode_entry(lay, 0, chain(2), encode_entry(lay, 0, chain(2), tensors)), tensors)


def _flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x10]) + data[offset + 1:]


@pytest.mark.parametrize("damage, match", [
    (lambda d: d[: len(d) - 100], "truncated|checksum"),
    (lambda d: d[:5], "too short"),
    (lambda d: _flip(d, len(d) - 7), "checksum"),
    (lambda d: _flip(d, 12), "header|metadata|namespace|expected"),
])
def test_damaged_entries_are_refused(damage, match):
    lay = layout("run")
    data = encode_entry(lay, 0, chain(2), pages(lay, 2))
    with pytest.raises(BadEntry, match=match):
        decode_entry(lay, 0, chain(2), damage(data))


def test_foreign_entries_are_refused():
    lay = layout("run")
    data = encode_entry(lay, 0, chain(2), pages(lay, 2))
    with pytest.raises(BadEntry, match="namespace"):
        decode_entry(layout("run", fingerprint=b"model-b"), 0, chain(2), data)
    with pytest.raises(BadEntry, match="pages"):
        decode_entry(lay, 0, chain(2, seed=1), data)
    with pytest.raises(BadEntry, match="first"):
        decode_entry(lay, 4, chain(2), data)
    same_namespace_other_shape = PageLayout(lay.namespace, lay.page_format, lay.layout_version,
                                            layout("quant").tensors)
    with pytest.raises(BadEntry, match="layout"):
        decode_entry(same_namespace_other_shape, 0, chain(2), data)
