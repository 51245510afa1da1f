"""The argument contract shared by the paged-attention kernels (Triton, CPU): shape checks and the
mask's broadcast strides. Layout and semantics: :mod:`hf_paged.kernels.reference`."""

from __future__ import annotations

import torch


def check_paged_args(query, k_pool, v_pool, page_table, page_pos, q_pos, mask, s_aux) -> None:
    """Raise ValueError/TypeError unless the arguments have the shapes of the contract."""
    B, Hq, Q, D = query.shape
    Hkv, Dk = k_pool.shape[2:]
    N = page_table.shape[1]
    if Dk != D or tuple(v_pool.shape) != tuple(k_pool.shape):
        raise ValueError(f"k_pool/v_pool must be [P, S, Hkv, {D}], got {tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if tuple(page_table.shape) != (B, N) or tuple(page_pos.shape) != (B, N) or tuple(q_pos.shape) != (B, Q):
        raise ValueError("page_table/page_pos must be [B, N] and q_pos [B, Q]")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be bool, got {mask.dtype}")
        if mask.dim() != 4 or mask.shape[0] not in (1, B) or mask.shape[1] not in (1, Hq) or mask.shape[2] != Q:
            raise ValueError(f"mask must be [B or 1, 1 or Hq, Q, M], got {tuple(mask.shape)}")
    if s_aux is not None and s_aux.shape != (Hq,):
        raise ValueError(f"s_aux must be [Hq] = [{Hq}], got {tuple(s_aux.shape)}")


def mask_strides(mask: torch.Tensor) -> list[int]:
    """Element strides of a checked ``[B or 1, 1 or Hq, Q, M]`` mask, 0 on its broadcast batch/head dims."""
    return [0 if i < 2 and mask.shape[i] == 1 else mask.stride(i) for i in range(4)]
