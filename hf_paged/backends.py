"""Which attention backend reads a layer's pages: "torch", "triton" or "cpu", chosen once per layer.

A layer resolves its backend when it first reads (the device and dtype of its pools are known
then) and hands the answer to attention in its view; attention only picks the kernel function.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

from .errors import CacheUsageError
from .kernels import cpu_paged_attention as cpu_kernel

BACKENDS = ("auto", "torch", "triton", "cpu")


def check_backend(backend) -> None:
    """Raise `CacheUsageError` unless ``backend`` is a cache's backend argument (None: ``$HF_PAGED_BACKEND``)."""
    if backend is not None and backend not in BACKENDS:
        raise CacheUsageError(f"backend must be 'auto', 'cpu', 'torch' or 'triton', got {backend!r}.")


def resolve_backend(choice: str | None, device: torch.device) -> str:
    """"torch", "triton" or "cpu" for ``device``: the choice, else ``$HF_PAGED_BACKEND``, else "auto".

    "auto" is the Triton kernel on CUDA and the C kernel on the CPU (when a C compiler can build it;
    otherwise the torch path, with one warning saying why).
    """
    return _resolve(choice or os.environ.get("HF_PAGED_BACKEND", "auto"), device.type)


def layer_backend(choice: str | None, pages) -> str:
    """`resolve_backend` for a layer's `LayerPages`: the C kernel reads its page formats (int8 and int4 whatever the
    model's dtype; float pages of its supported dtypes; both tiers of "float+int4" / "float+int8" pages), else
    "torch" (which reads every format through gathers)."""
    backend = resolve_backend(choice, pages.device)
    if backend != "cpu":
        return backend
    formats = pages.kv_format.split("+")  # (two tiers, `hf_paged.demotion`: "float+int4")
    if formats[0] == "float" and pages.dtype not in cpu_kernel.SUPPORTED_DTYPES:
        return "torch"
    return backend if all(name in cpu_kernel.KV_FORMATS for name in formats) else "torch"


@functools.lru_cache(maxsize=None)
def _resolve(choice: str, device_type: str) -> str:
    """Cached per (choice, device type)."""
    if choice not in BACKENDS:
        raise ValueError(f"hf_paged backend must be one of {BACKENDS}, got {choice!r} "
                         "(argument `backend=` or environment variable HF_PAGED_BACKEND).")
    if choice == "auto":
        if device_type == "cuda":
            return "triton" if importlib.util.find_spec("triton") else "torch"
        if device_type == "cpu":
            reason = cpu_kernel.unavailable_reason()
            if reason is None:
                return "cpu"
            warnings.warn(f"hf_paged: the CPU attention kernel is unavailable ({reason}); using the slower torch "
                          "path.", stacklevel=4)  # once: the answer is cached
        return "torch"
    if choice == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("The Triton backend needs CUDA tensors, or TRITON_INTERPRET=1 (set before triton is "
                         "imported) to run the kernel on the CPU; use backend='torch' otherwise.")
    if choice == "cpu":
        if device_type != "cpu":
            raise ValueError(f"The 'cpu' backend runs on CPU tensors, got {device_type}; use 'auto' or 'triton'.")
        reason = cpu_kernel.unavailable_reason()
        if reason is not None:
            raise ValueError(f"The 'cpu' backend cannot run: {reason}. Install a C compiler (or set $CC), "
                             "or use backend='torch'.")
    return choice
