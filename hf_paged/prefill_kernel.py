"""A packed step's prefill chunks in one C-kernel call (`cpu_paged_attention.prefill_attention_cpu`).

On the CPU, float pages and layers with no sliding window, softcap or sinks, every multi-token segment of a packed
step attends its sequence's pages read in place, causally, in one call for all of them and for every query head:
the kernel copies a sequence's keys once per KV head into a transposed scratch and computes 8 query rows' scores
per key vector, where PyTorch's flash kernel, called per chunk (and once more over a shared prefix, merged), pays
its fixed costs per call and computes whole blocks on the causal diagonal (docs/many_prompts.md, "Prefill chunks in
one kernel call").

Invariant: the index (each segment's page table, and its start, length and past) is built once per step on the host
from the step's plan, and checked once against the layer's pool size by the kernel's wrapper.
"""

from __future__ import annotations

import torch

from .kernels import cpu_paged_attention as cpu_kernel


def prefill_kernel_applies(view, sliding_window, softcap, s_aux) -> bool:
    """The step's prefill chunks can run in the C prefill kernel: CPU float pools of one tier with contiguous rows,
    head dims equal and a multiple of 16, no window, softcap or sinks, every segment's table from its first page."""
    if sliding_window or softcap or s_aux is not None or view.backend != "cpu":
        return False
    operands = view.pages.kernel_operands()
    k_pool, v_pool = operands["k_pool"], operands["v_pool"]
    return (operands["kv_format"] == "float" and operands.get("cold") is None and k_pool.is_cpu
            and k_pool.dtype in cpu_kernel.SUPPORTED_DTYPES and k_pool.shape[3] == v_pool.shape[3]
            and k_pool.shape[3] % 16 == 0 and not any(s.first_page for s in view.plan.segments))


def _prefill_index(step, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(table [n, W], segments [n, 3] of (start, length, past)) of ``step.segments[first:]``, made once per step;
    a table's padding repeats its first page (a valid id the kernel never reads)."""
    index = step._on_device.get("prefill")
    if index is None:
        chunks = step.segments[first:]
        width = max(len(s.pages) for s in chunks)
        table = torch.stack([torch.cat([s.pages, s.pages[:1].expand(width - len(s.pages))]) for s in chunks])
        segments = torch.tensor([[s.start, s.length, s.past] for s in chunks], dtype=torch.long)
        index = step._on_device["prefill"] = (table.to(torch.long).contiguous(), segments)
    return index


def prefill_kernel_attention(query: torch.Tensor, view, first: int, scaling: float) -> torch.Tensor:
    """``[1, T, Hq, D]`` float32 attention of ``query [1, Hq, T, D]``'s tokens of segments ``first ..`` over their
    pages (the rows of segments before ``first`` are left undefined for the caller to fill)."""
    operands = view.pages.kernel_operands()
    table, segments = _prefill_index(view.plan, first)
    q = query[0].transpose(0, 1)
    out = cpu_kernel.prefill_attention_cpu(q if q.dtype == torch.float32 else q.float(), operands["k_pool"],
                                           operands["v_pool"], table, segments, scaling)
    return out.unsqueeze(0)
