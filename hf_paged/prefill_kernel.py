"""Prefill in one C-kernel call (`cpu_paged_attention.prefill_attention_cpu`): a packed step's chunks, or a batch's
rows of a `PagedCache` step.

On the CPU, float or quantized (int8, int4, int2) pages and layers with no sliding window, softcap or sinks, every
multi-token segment of a packed step (`generate_many`), or every row of a `PagedCache` step of more queries than the
decode kernel takes with no mask to apply (no padding, no evicted pages, no usage to measure), attends its pages read in
place, causally, in one call for all of them and for every query head: the kernel copies a sequence's keys once per KV
head into a transposed scratch and computes 8 query rows' scores per key vector (about 80 GFLOP/s on SmolLM2's shapes,
where PyTorch's flash kernel called per chunk ran these small causal calls at 25-47: docs/many_prompts.md, "Prefill
chunks in one kernel call").

Invariant: the index (each segment's or row's page table, and its start, length and past) is built once per step on
the host from the step's plan, and checked against the layer's pool by the kernel's wrapper at every call; a row's
table is used only where every page it covers is held (no hole).
"""

from __future__ import annotations

import torch

from .kernels import cpu_paged_attention as cpu_kernel


def _kernel_pages(view, sliding_window, softcap, s_aux) -> bool:
    """CPU pools of one tier that the kernel reads (float32 or bfloat16 float pages, int8, int4 or int2 ones:
    `cpu_paged_attention.prefill_entry`), head dims equal and a multiple of 16, read by the C kernel ("cpu"
    backend), for a layer with no window, softcap or sinks."""
    if sliding_window or softcap or s_aux is not None or view.backend != "cpu":
        return False
    operands = view.pages.kernel_operands()
    k_pool, kv_format = operands["k_pool"], operands["kv_format"]
    _, head_dim, value_dim, _ = view.pages.shape
    return (cpu_kernel.prefill_entry(kv_format, k_pool.dtype) is not None and operands.get("cold") is None
            and k_pool.is_cpu and head_dim == value_dim and head_dim % 16 == 0)


def prefill_kernel_applies(view, sliding_window, softcap, s_aux) -> bool:
    """The packed step's prefill chunks can run in the C prefill kernel: `_kernel_pages`, and every segment's table
    from its first page."""
    return _kernel_pages(view, sliding_window, softcap, s_aux) and not any(s.first_page for s in view.plan.segments)


def rows_kernel_applies(view, module, attention_mask, sliding_window, softcap, s_aux) -> bool:
    """A `PagedCache` step's rows can run in the C prefill kernel: `_kernel_pages`, causal with no mask (no padding),
    every token from the first held (no window start, no evicted page: no hole in the tables), no usage to measure."""
    plan = view.plan
    return (attention_mask is None and getattr(module, "is_causal", True) and view.probe is None
            and plan.read_table is None and plan.first_pos == 0
            and _kernel_pages(view, sliding_window, softcap, s_aux) and _rows_index(plan) is not None)


def _rows_index(plan) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(table [B, W], segments [B, 3]) of a `StepPlan`'s rows (row b: queries ``b * Q ..``, past ``plan.past``), its
    tables cut to the pages that hold ``num_tokens``; None where one of those is not held. Made once per step."""
    if "prefill_rows" not in plan._on_device:
        B, Q, S = plan.batch_size, plan.q_len, plan.page_size
        table = plan.table[:, :(plan.num_tokens + S - 1) // S]
        segments = torch.tensor([[b * Q, Q, plan.past] for b in range(B)], dtype=torch.long)
        plan._on_device["prefill_rows"] = None if bool((table < 0).any()) else (table.contiguous(), segments)
    return plan._on_device["prefill_rows"]


def rows_prefill_attention(query: torch.Tensor, view, scaling: float) -> torch.Tensor:
    """``[B, Q, Hq, D]`` attention (in the query's dtype) of a `PagedCache` step's ``query [B, Hq, Q, D]`` over each
    row's pages, causal (`rows_kernel_applies`)."""
    B, Hq, Q, D = query.shape
    out = _attend(query.transpose(1, 2).reshape(B * Q, Hq, D), view, _rows_index(view.plan), scaling)
    return out.view(B, Q, Hq, D).to(query.dtype)


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
    return _attend(query[0].transpose(0, 1), view, _prefill_index(view.plan, first), scaling).unsqueeze(0)


def _attend(rows: torch.Tensor, view, index: tuple[torch.Tensor, torch.Tensor], scaling: float) -> torch.Tensor:
    """``[T, Hq, D]`` float32 attention of the query ``rows [T, Hq, D]`` over the layer's pages by ``index``
    (table, segments)."""
    operands = view.pages.kernel_operands()
    return cpu_kernel.prefill_attention_cpu(rows if rows.dtype == torch.float32 else rows.float(), operands["k_pool"],
                                            operands["v_pool"], *index, scaling, operands.get("k_scale"),
                                            operands.get("v_scale"), operands["kv_format"])
