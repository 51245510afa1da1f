"""Tests of the Triton paged-attention kernel against the float64 reference.

Without CUDA the kernels run on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1``, set below before triton is imported); shapes are kept
tiny so the whole file runs in well under two minutes there.

The reference itself is checked against an independent dense computation
(gather all pages, explicit mask, ``torch.softmax``) and a hand-computed case.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import kernel_cases
import pytest
import torch
from kernel_cases import (KERNEL_CASES, QUANTIZED_FORMATS, assert_matches_reference, quantize_case, rel_err,
                          two_tier_case)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from hf_paged.kernels.reference import paged_attention_reference  # noqa: E402
from hf_paged.kernels.triton_paged_attention import (  # noqa: E402
    _choose_num_splits,
    paged_attention_triton,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_case(**kw) -> dict:
    kw.setdefault("device", DEVICE)
    return kernel_cases.make_case(**kw)


def run_kernel(case: dict, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel into an output buffer poisoned with NaN, with page mass."""
    q = case["query"]
    B, Hq, Q, D = q.shape
    out = torch.full((B, Q, Hq, D), float("nan"), dtype=q.dtype, device=q.device)
    res, mass = paged_attention_triton(**case, return_page_mass=True, out=out, **kw)
    assert res is out
    assert torch.isfinite(out).all(), "output left unwritten (NaN) or non-finite"
    assert mass.dtype == torch.float32 and mass.shape == (B, Hq, case["page_table"].shape[1])
    return out, mass


def check_against_reference(case: dict, **kw) -> None:
    """The kernel's output and page mass against the reference. A quantized tile is dequantized in fp32 and
    rounded to the query's dtype for its dot (what tensor cores multiply), a rounding the reference does not
    have: twice the dtype's tolerance then for half-precision queries."""
    dtype = case["query"].dtype
    quantized = case.get("kv_format", "float") != "float" or case.get("cold") is not None
    half_quantized = quantized and dtype != torch.float32
    assert_matches_reference(case, *run_kernel(case, **kw), tol=2 * kernel_cases.TOL[dtype] if half_quantized else None)


# --------------------------------------------------------------------------- #
# The oracle: reference vs an independent dense computation
# --------------------------------------------------------------------------- #
def dense_attention(query, k_pool, v_pool, page_table, page_pos, q_pos, *, scale, mask=None, mask_offset=0,
                    sliding_window=None, softcap=None, s_aux=None):
    """All pages gathered to [B, Hkv, T = N * S, D], one explicit [B, Hq, Q, T] mask, torch.softmax."""
    B, Hq, Q, D = query.shape
    P, S, Hkv, _ = k_pool.shape
    N = page_table.shape[1]
    T = N * S
    f64 = torch.float64
    pt = page_table.long()
    K = k_pool.to(f64)[pt.clamp(min=0)].reshape(B, T, Hkv, D).transpose(1, 2)
    V = v_pool.to(f64)[pt.clamp(min=0)].reshape(B, T, Hkv, D).transpose(1, 2)
    K = K.repeat_interleave(Hq // Hkv, dim=1)  # [B, Hq, T, D]
    V = V.repeat_interleave(Hq // Hkv, dim=1)
    pos = (page_pos.long()[:, :, None] + torch.arange(S, device=page_pos.device)).reshape(B, T)
    exists = (pt >= 0)[:, :, None].expand(B, N, S).reshape(B, T)

    allowed = exists[:, None, None, :] & (pos[:, None, None, :] <= q_pos[:, None, :, None])  # [B, 1, Q, T]
    if sliding_window is not None:
        allowed = allowed & (q_pos[:, None, :, None] - pos[:, None, None, :] < sliding_window)
    allowed = allowed.expand(B, Hq, Q, T)
    if mask is not None:
        M = mask.shape[-1]
        idx = pos - mask_offset
        inside = (idx >= 0) & (idx < M)
        full = mask.expand(B, Hq, Q, M)
        looked = torch.gather(full, 3, idx.clamp(0, M - 1)[:, None, None, :].expand(B, Hq, Q, T))
        allowed = allowed & inside[:, None, None, :] & looked

    logits = torch.einsum("bhqd,bhtd->bhqt", query.to(f64), K) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~allowed, float("-inf"))
    if s_aux is not None:
        logits = torch.cat([logits, s_aux.to(f64)[None, :, None, None].expand(B, Hq, Q, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :T]
    probs = torch.nan_to_num(probs, nan=0.0)  # all -inf rows
    V = V.masked_fill(~allowed.any(dim=2)[..., None], 0.0)  # never-attended slots may be NaN
    out = (probs @ V).transpose(1, 2)
    mass = probs.reshape(B, Hq, Q, N, S).sum(-1).mean(2)
    return out, mass


@pytest.mark.parametrize("variant", ["mask-gqa", "window-softcap-sink-mqa"])
def test_reference_matches_dense(variant):
    if variant == "mask-gqa":
        case = make_case(B=2, Hq=4, Hkv=2, D=8, S=3, Q=3, lengths=[10, 7], pad=[2, 0], drop_page=True,
                         mask_per_head=True, mask_offset=1, dtype=torch.float64, device=torch.device("cpu"))
    else:
        case = make_case(B=2, Hq=3, Hkv=1, D=8, S=4, Q=2, lengths=[13, 6], sliding_window=5, softcap=2.0,
                         sink=True, dtype=torch.float64, device=torch.device("cpu"))
    out, mass = paged_attention_reference(**case, return_page_mass=True)
    d_out, d_mass = dense_attention(**case)
    assert out.dtype == torch.float64 and out.shape == d_out.shape
    torch.testing.assert_close(out, d_out.to(out.dtype), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(mass.double(), d_mass, rtol=1e-6, atol=1e-6)


def test_reference_hand_computed():
    """Zero query -> uniform scores: the output is a plain average, the sink adds exp(s_aux) mass."""
    S, D = 2, 4
    k_pool = torch.randn(2, S, 1, D, dtype=torch.float64)
    v_pool = torch.arange(2 * S * D, dtype=torch.float64).reshape(2, S, 1, D)
    query = torch.zeros(1, 1, 1, D, dtype=torch.float64)
    page_table = torch.tensor([[1, -1, 0]], dtype=torch.int32)
    page_pos = torch.tensor([[2, 77, 0]])
    q_pos = torch.tensor([[3]])
    common = dict(scale=1.0, return_page_mass=True)
    out, mass = paged_attention_reference(query, k_pool, v_pool, page_table, page_pos, q_pos, **common)
    torch.testing.assert_close(out[0, 0, 0], v_pool.reshape(4, D).mean(0))
    torch.testing.assert_close(mass, torch.tensor([[[0.5, 0.0, 0.5]]]))
    # sink logit log(4): denominator 4 * e^0 + 4 = 8.
    out, mass = paged_attention_reference(query, k_pool, v_pool, page_table, page_pos, q_pos,
                                          s_aux=torch.tensor([math.log(4.0)]), **common)
    torch.testing.assert_close(out[0, 0, 0], v_pool.reshape(4, D).sum(0) / 8)
    torch.testing.assert_close(mass, torch.tensor([[[0.25, 0.0, 0.25]]]))
    # causality: q_pos 2 sees positions 0, 1, 2 only (page 1 holds positions 2, 3).
    out = paged_attention_reference(query, k_pool, v_pool, page_table, page_pos, torch.tensor([[2]]), scale=1.0)
    torch.testing.assert_close(out[0, 0, 0], (v_pool[0, 0, 0] + v_pool[0, 1, 0] + v_pool[1, 0, 0]) / 3)


# --------------------------------------------------------------------------- #
# Kernel vs reference
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_reference(name):
    check_against_reference(make_case(seed=1, **KERNEL_CASES[name]))


@pytest.mark.parametrize("kv_format", QUANTIZED_FORMATS)
@pytest.mark.parametrize("name", ["gqa-page3-chunk-leftpad-fp32", "mqa-page16-decode-bf16-window-softcap-sink"])
def test_quantized_pages_match_reference(kv_format, name):
    """Pools in int8 / int4 / int2 / fp8_e4m3 (page sizes 3 and 16, partial pages, holes, an evicted page, GQA/MQA, a
    mask, a window, a softcap, sinks, page mass): tiles dequantized in the kernel as the reference does."""
    check_against_reference(quantize_case(make_case(seed=4, **KERNEL_CASES[name]), kv_format))


@pytest.mark.parametrize("kv_format", ["int4", "int2", "fp8_e4m3"])
def test_quantized_split_k_and_head_dim_24(kv_format):
    """Split partials of quantized pools (int4: the output rotated back after the splits are merged); head dim
    24 (int4 keys: a step per channel; a tile wider than the head)."""
    case = quantize_case(make_case(B=2, Hq=4, Hkv=2, D=24, S=5, Q=2, lengths=[70, 23], sink=True, seed=9), kv_format)
    for splits in (1, 3):
        check_against_reference(case, num_splits=splits)


@pytest.mark.parametrize("cold", ["int8", "int4", "int2"])
@pytest.mark.parametrize("name", ["mha-page1-decode-fp32", "gqa-page3-chunk-leftpad-fp32",
                                  "mqa-page16-decode-bf16-window-softcap-sink"])
def test_two_tier_pages_match_reference(cold, name):
    """A two-tier layer (`hf_paged.demotion.MixedPages`: hot float pages, a random half of the pages cold in
    int8 / int4, interleaved; holes, an evicted page, page sizes 1, 3 and 16, masks, a window, a softcap, sinks,
    page mass): each program reads its hot pages, then its cold ones dequantized (int4: the query and the running
    sum rotated into the cold basis in the kernel, the output rotated back after it)."""
    check_against_reference(two_tier_case(make_case(seed=4, **KERNEL_CASES[name]), cold, seed=2)[0])


@pytest.mark.parametrize("cold", ["int8", "int4", "int2"])
def test_two_tier_split_k_and_head_dim_24(cold):
    """Split partials of two tiers (each split ends in the cold basis); head dim 24 (int4 keys in groups of 8, a
    rotation of blocks of 8 padded into the tile)."""
    case, _ = two_tier_case(make_case(B=2, Hq=4, Hkv=2, D=24, S=1, Q=2, lengths=[40, 23], sink=True, seed=9), cold,
                            seed=3)
    for splits in (1, 3):
        check_against_reference(case, num_splits=splits)


def test_kernel_default_output_allocation():
    case = make_case(B=2, Hq=4, Hkv=2, D=16, S=3, Q=2, lengths=[7, 5], seed=2)
    out = paged_attention_triton(**case)
    ref = paged_attention_reference(**case)
    assert out.shape == (2, 2, 4, 16) and out.dtype == torch.float32
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("Q", [1, 3])
def test_split_k(Q):
    """Forced splits (including more splits than tiles: empty splits) match one split and the reference."""
    case = make_case(B=2, Hq=4, Hkv=2, D=16, S=16, Q=Q, lengths=[150, 37], sink=True, seed=3)
    ref_out, ref_mass = paged_attention_reference(**case, return_page_mass=True)
    for splits in (1, 3, 7):
        out, mass = run_kernel(case, num_splits=splits)
        assert rel_err(out, ref_out) <= 1e-5, (splits, rel_err(out, ref_out))
        assert float((mass - ref_mass).abs().max()) <= 1e-5


def test_split_count_follows_context_length():
    cpu = torch.device("cpu")
    assert _choose_num_splits(num_programs=1, num_slots=128, device=cpu) == 1  # short context
    long_ctx = _choose_num_splits(num_programs=1, num_slots=1 << 16, device=cpu)
    assert long_ctx > 1
    assert _choose_num_splits(num_programs=1, num_slots=1024, device=cpu) <= long_ctx
    assert _choose_num_splits(num_programs=10_000, num_slots=1 << 16, device=cpu) == 1  # grid already full
    # The automatic choice (several splits here) is what a call without num_splits uses.
    case = make_case(B=1, Hq=2, Hkv=1, D=16, S=64, Q=1, lengths=[1000], holes=False, seed=4)
    assert _choose_num_splits(num_programs=1, num_slots=case["page_table"].shape[1] * 64, device=cpu) > 1
    check_against_reference(case)


@pytest.mark.parametrize("splits", [1, 2])
def test_fully_masked_rows_give_zeros(splits):
    case = make_case(B=2, Hq=4, Hkv=2, D=16, S=3, Q=3, lengths=[9, 6], pad=[0, 0], seed=5)
    case["mask"][0, :, 1, :] = False  # query 1 of row 0 sees nothing
    case["q_pos"][1, 0] = -1  # query 0 of row 1 precedes every cached token
    for sink in (False, True):
        case["s_aux"] = torch.randn(4, device=DEVICE) if sink else None
        out, mass = run_kernel(case, num_splits=splits)
        assert torch.all(out[0, 1] == 0) and torch.all(out[1, 0] == 0)
        assert out[0, 0].abs().sum() > 0
        ref_out, ref_mass = paged_attention_reference(**case, return_page_mass=True)
        assert rel_err(out, ref_out) <= 1e-5
        assert float((mass - ref_mass).abs().max()) <= 1e-5


def test_reference_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import hf_paged.kernels.reference as r\n"
        "assert callable(r.paged_attention_reference)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
