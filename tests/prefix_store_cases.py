"""Layouts, page hashes and page tensors for the prefix store tests (also imported by their subprocesses)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import torch

from hf_paged.prefix_store import PageLayout

TESTS = os.path.dirname(os.path.abspath(__file__))


def layout(kind: str = "run", fingerprint: bytes = b"model-a", **overrides) -> PageLayout:
    """``"run"``: 128 KiB pages, 4 pages an entry; ``"page"``: 512 KiB pages, one page an entry;
    ``"quant"``: int8 keys and uint8 values with float32 scales per token and head (4 pages an entry)."""
    if kind == "run":
        tensors = {f"{kv}.{layer}": ((16, 4, 128), torch.float32) for layer in range(2) for kv in "kv"}
    elif kind == "page":
        tensors = {f"{kv}.{layer}": ((16, 4, 1024), torch.bfloat16) for layer in range(2) for kv in "kv"}
    elif kind == "quant":
        tensors = {}
        for layer in range(3):
            tensors[f"k.{layer}"] = ((16, 4, 256), torch.int8)
            tensors[f"v.{layer}"] = ((16, 4, 256), torch.uint8)
            tensors[f"k_scale.{layer}"] = ((16, 4, 1), torch.float32)
            tensors[f"v_scale.{layer}"] = ((16, 4, 1), torch.float32)
    else:
        raise ValueError(kind)
    args = dict(model_fingerprint=fingerprint, dtype=torch.float32, page_size=16, layer_windows=[None, None],
                device_type="cpu", page_format=f"kv-{kind}", layout_version=1, tensors=tensors)
    return PageLayout.create(**{**args, **overrides})


def chain(pages: int, seed: int = 0) -> list[bytes]:
    """Chained page hashes of a sequence (``seed`` picks the sequence)."""
    hashes, parent = [], seed.to_bytes(8, "little")
    for page in range(pages):
        parent = hashlib.sha256(parent + page.to_bytes(8, "little")).digest()
        hashes.append(parent)
    return hashes


def pages(layout: PageLayout, count: int, seed: int = 0, first: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic tensors for pages ``first .. first + count - 1`` (page i's values depend on seed and i only)."""
    out = {}
    for spec in layout.tensors:
        per_page = []
        for page in range(first, first + count):
            g = torch.Generator().manual_seed(seed * 1_000_003 + page * 101 + len(spec.name))
            if spec.dtype.is_floating_point:
                per_page.append(torch.randn(spec.shape, generator=g).to(spec.dtype))
            else:
                info = torch.iinfo(spec.dtype)
                per_page.append(torch.randint(info.min, info.max + 1, spec.shape, generator=g, dtype=spec.dtype))
        out[spec.name] = torch.stack(per_page)
    return out


def same_pages(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality of two page dicts (bfloat16 compared by bits)."""
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def joined(runs) -> dict[str, torch.Tensor]:
    """The tensors of consecutive PageRuns, concatenated along pages."""
    return {name: torch.cat([run.tensors[name] for run in runs]) for name in runs[0].tensors}


def store_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "prefix store" in str(w.message)]


def run_python(code: str, *args: str, prefix: list[str] | None = None, timeout: float = 600) -> dict:
    """Run ``code`` in a fresh interpreter (this folder importable); returns the JSON it prints last."""
    script = "import sys; sys.path.insert(0, %r)\n" % TESTS + textwrap.dedent(code)
    result = subprocess.run([*(prefix or []), sys.executable, "-c", script, *args], capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])

