"""``hf_paged::paged_attention``: the paged kernels as one custom op, for compiled forwards.

`torch.compile` cannot trace a ctypes call or a Triton launch made from Python objects; as a
`torch.library.custom_op` the kernel is one opaque node of the graph that takes tensors only (the
pools and the step's index) and whose fake implementation gives the output's shape. The real
implementation runs the kernel the layer's backend names: the C kernel (``"cpu"``), the Triton
kernel (``"triton"``), or the float64 reference (``"torch"``: no compiler; slow, correct). The mask's
offset is taken from the index (the last query's position is the newest token, the mask's last column),
so no Python int that advances every step enters the graph.
"""

from __future__ import annotations

import torch

from . import cpu_paged_attention
from .reference import paged_attention_reference


def _kernel(backend: str):
    if backend == "cpu":
        return cpu_paged_attention.paged_attention_cpu
    if backend == "triton":
        from .triton_paged_attention import paged_attention_triton

        return paged_attention_triton
    return paged_attention_reference


@torch.library.custom_op("hf_paged::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                    page_pos: torch.Tensor, q_pos: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    sliding_window: int | None, softcap: float | None, s_aux: torch.Tensor | None,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, kv_format: str,
                    backend: str) -> torch.Tensor:
    """Paged attention of ``query [B, Hq, Q, D]`` (arguments as `paged_attention_reference`; ``mask`` boolean, its
    last column the newest token); returns ``[B, Q, Hq, Dv]`` in ``query.dtype``."""
    mask_offset = 0 if mask is None else int(q_pos[0, -1]) + 1 - mask.shape[-1]
    out = _kernel(backend)(query, k_pool, v_pool, page_table, page_pos, q_pos, scale=scale, mask=mask,
                           mask_offset=mask_offset, sliding_window=sliding_window, softcap=softcap, s_aux=s_aux,
                           k_scale=k_scale, v_scale=v_scale, kv_format=kv_format)
    return out.to(query.dtype).contiguous()


@paged_attention.register_fake
def _(query, k_pool, v_pool, page_table, page_pos, q_pos, mask, scale, sliding_window, softcap, s_aux, k_scale,
      v_scale, kv_format, backend):
    B, Hq, Q, _ = query.shape
    return query.new_empty(B, Q, Hq, v_pool.shape[-1])
