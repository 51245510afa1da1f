"""Tests of the C paged-attention kernel (`hf_paged.kernels.cpu_paged_attention`) against the float64
reference, its build and fallback, and its use by `generate` (token-identical to DynamicCache)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import TOL, KERNEL_CASES, assert_matches_reference, make_case, quantize_case, rel_err
from tiny_models import left_padded_batch, make_pair

import hf_paged
from hf_paged import backends
from hf_paged.kernels import cpu_paged_attention as cpu_kernel
from hf_paged.kernels.reference import paged_attention_reference

pytestmark = pytest.mark.skipif(cpu_kernel.unavailable_reason() is not None,
                                reason=f"CPU kernel unavailable: {cpu_kernel.unavailable_reason()}")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check(case: dict, **kw) -> None:
    out, mass = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, **kw)
    assert out.dtype == case["query"].dtype and torch.isfinite(out).all()
    assert_matches_reference(case, out, mass, mass_tol=1e-5)


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_matches_reference(name, splits):
    """The shared cases; float16 ones (pools the kernel does not read) run in bfloat16 and float32."""
    if KERNEL_CASES[name].get("dtype") == torch.float16:
        for dtype in (torch.bfloat16, torch.float32):
            check(make_case(seed=1, **dict(KERNEL_CASES[name], dtype=dtype)), num_splits=splits)
    else:
        check(make_case(seed=1, **KERNEL_CASES[name]), num_splits=splits)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", list(KERNEL_CASES))
@pytest.mark.parametrize("kv_format", ["int8", "int4", "int2"])
def test_quantized_pages_match_reference(kv_format, name, splits):
    """The shared cases (page sizes 1, 3, 4 and 16, partial pages, holes, an evicted page, GQA/MQA, masks, a
    window, softcaps, sinks, page mass) with pools in int8 / int4 / int2, passed as the pages' ``kernel_operands()``:
    the kernel dequantizes (and un-rotates int4) as the reference does; float16 cases run in float32."""
    shape = dict(KERNEL_CASES[name])
    shape["dtype"] = torch.float32 if shape.get("dtype") == torch.float16 else shape.get("dtype", torch.float32)
    check(quantize_case(make_case(seed=4, **shape), kv_format), num_splits=splits)


@pytest.mark.parametrize("kv_format", ["int8", "int4", "int2"])
@pytest.mark.parametrize("D", [8, 24, 48, 80])
def test_quantized_head_dims(kv_format, D):
    """Head dims a multiple of 16 read 16 lanes at a time, others element by element."""
    case = make_case(B=2, Hq=6, Hkv=3, D=D, S=20, Q=2, lengths=[75, 41], pad=[3, 0], seed=D)
    check(quantize_case(case, kv_format), num_splits=2)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", ["mha-page1-decode-fp32", "gqa-d24-perhead-mask-offset-fp16"])
def test_page_mass_reduced_over_heads_in_the_kernel(name, splits):
    """``page_mass_heads`` returns the heads' mean or max ``[B, N]`` of the per-head page mass, the same
    attention output; anything else is refused."""
    case = make_case(seed=2, **dict(KERNEL_CASES[name], dtype=torch.float32))
    out, mass = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, num_splits=splits)
    for heads, reduce in (("mean", lambda m: m.mean(dim=1)), ("max", lambda m: m.amax(dim=1))):
        reduced_out, reduced = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, num_splits=splits,
                                                              page_mass_heads=heads)
        assert reduced.shape == mass.shape[::2] and torch.equal(reduced_out, out)
        torch.testing.assert_close(reduced, reduce(mass), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="page_mass_heads"):
        cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, page_mass_heads="sum")


def test_page_mass_written_into_a_given_buffer():
    """``page_mass_out`` (a row of a larger buffer) receives every entry of the reduced page mass, as a new tensor
    would, and is returned; a buffer of another shape or dtype, or without a head reduction, is refused."""
    case = make_case(seed=3, **dict(KERNEL_CASES["mha-page1-decode-fp32"], dtype=torch.float32))
    out, mass = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, page_mass_heads="mean")
    buffer = torch.full((3, *mass.shape), float("nan"))
    row = buffer.unbind()[1]
    given_out, given = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, page_mass_heads="mean",
                                                      page_mass_out=row)
    assert given is row and torch.equal(given, mass) and torch.equal(given_out, out)
    assert buffer[0].isnan().all() and buffer[2].isnan().all()
    for wrong, heads in ((torch.zeros(mass.shape[0], mass.shape[1] + 1), "mean"), (torch.zeros(mass.shape).double(),
                         "mean"), (torch.zeros(mass.shape), None)):
        with pytest.raises(ValueError, match="page_mass_out"):
            cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, page_mass_heads=heads, page_mass_out=wrong)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("shape", [
    dict(B=3, Hq=2, Hkv=2, D=32, S=1, Q=1, lengths=[5, 9, 2]),  # decode, shuffled pages, holes
    dict(B=2, Hq=6, Hkv=2, D=24, S=1, Q=3, lengths=[30, 17], pad=[2, 0], mask_per_head=True, softcap=4.0, sink=True,
         dtype=torch.bfloat16),
    dict(B=2, Hq=9, Hkv=3, D=48, S=1, Q=2, lengths=[40, 23], pad=[0, 3], dtype=torch.bfloat16)])  # 3 heads a value row
def test_output_signal_matches_reference(shape, splits, threads, monkeypatch):
    """``page_mass_signal="output"``: how far each token moves its head's output, as the reference defines it
    (several queries, a per-head mask, sinks, bfloat16 pools, the heads of a KV head reading a value row
    together, on 1 and 2 threads); the attention output is a plain call's (which takes the float walk: up to the
    order of float additions), the heads' reduction applies to it; refused for pages of several tokens."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    case = make_case(seed=3, **shape)
    out, moved = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, num_splits=splits,
                                                page_mass_signal="output")
    _, want = paged_attention_reference(**case, return_page_mass=True, page_mass_signal="output")
    torch.testing.assert_close(moved, want, rtol=1e-4, atol=1e-5)
    assert rel_err(out, cpu_kernel.paged_attention_cpu(**case, num_splits=splits)) <= TOL[out.dtype]  # (float walk)
    assert torch.all(moved.masked_select((case["page_table"] < 0)[:, None, :]) == 0)
    _, mass = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, num_splits=splits)
    assert not torch.allclose(moved, mass, rtol=0.1)  # another signal than the attention mass
    _, mean = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, num_splits=splits,
                                             page_mass_signal="output", page_mass_heads="mean")
    torch.testing.assert_close(mean, moved.mean(dim=1), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="page_mass_signal"):
        cpu_kernel.paged_attention_cpu(**make_case(seed=3, **KERNEL_CASES["gqa-page3-chunk-leftpad-fp32"]),
                                       return_page_mass=True, page_mass_signal="output")


@pytest.mark.parametrize("kv_format", ["int8", "int4", "int2"])
def test_output_signal_of_quantized_pages(kv_format):
    """The output signal reads each token's dequantized value (int4: in the rotated basis, where distances are
    the same)."""
    case = quantize_case(make_case(B=2, Hq=9, Hkv=3, D=48, S=1, Q=2, lengths=[40, 23], pad=[0, 3], seed=3,
                                   dtype=torch.bfloat16), kv_format)
    for splits in (1, 3):
        _, moved = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, num_splits=splits,
                                                  page_mass_signal="output")
        _, want = paged_attention_reference(**case, return_page_mass=True, page_mass_signal="output")
        torch.testing.assert_close(moved, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("Hq,Hkv,Q", [(6, 3, 2), (9, 3, 1), (9, 3, 2), (3, 3, 3)])
@pytest.mark.parametrize("D", [8, 24, 48, 64, 80])
def test_head_dims(D, Hq, Hkv, Q):
    """Multiples of 16 take the lane-sum-tree path (a head dim of 64 its own unrolled code), others one dot product
    per slot; query rows of a KV head (GQA group x queries) add values in blocks of 4, or 3 when 3 are left: all
    exact."""
    check(make_case(B=2, Hq=Hq, Hkv=Hkv, D=D, S=20, Q=Q, lengths=[75, 41], pad=[3, 0], seed=D), num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,Q", [(9, 3, 1), (16, 2, 1), (6, 3, 2), (4, 4, 3)])
@pytest.mark.parametrize("D", [16, 64, 80, 128])
def test_float_walk_matches_reference(D, Hq, Hkv, Q, dtype):
    """A call with no page mass, mask, window or softcap on float pages takes the kernel's float walk (its slots 256 at
    a time): rows longer than a block, blocks that end mid-page, -1 holes, shuffled and evicted pages, NaN in every
    slot no query attends, query rows of a KV head in blocks of 4 and the rest, head dims of 1 to 8 blocks of 16
    lanes, with and without splits; its log-sum-exp too."""
    case = make_case(B=3, Hq=Hq, Hkv=Hkv, D=D, S=20, Q=Q, lengths=[600, 75, 257], drop_page=True, sink=Q == 1,
                     seed=D + Hq + Q, dtype=dtype)
    for splits in (1, 3):
        out, lse = cpu_kernel.paged_attention_cpu(**case, num_splits=splits, return_lse=True)
        assert torch.isfinite(out).all() and rel_err(out, paged_attention_reference(**case)) <= TOL[dtype]
        full, _, full_lse = cpu_kernel.paged_attention_cpu(**case, num_splits=splits, return_lse=True,
                                                           return_page_mass=True)  # (the general walk)
        assert rel_err(out, full) <= TOL[dtype] and torch.allclose(lse, full_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_format", ["float", "int8", "int4", "int2"])
@pytest.mark.parametrize("threads", [1, 2])
def test_long_row_automatic_splits(threads, kv_format):
    """Several chunks per page (page size 80 > the kernel's chunk), automatic splits on 2 threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        case = make_case(B=2, Hq=6, Hkv=2, D=64, S=80, Q=1, lengths=[1500, 700], sink=True, seed=6)
        assert (cpu_kernel._choose_num_splits(2, case["page_table"].shape[1] * 80, threads) > 1) == (threads > 1)
        check(case if kv_format == "float" else quantize_case(case, kv_format))
    finally:
        torch.set_num_threads(before)


def test_page_mass_with_several_queries_and_per_head_mask():
    check(make_case(B=2, Hq=4, Hkv=1, D=16, S=5, Q=4, lengths=[23, 17], pad=[2, 4], mask_per_head=True,
                    softcap=4.0, seed=7), num_splits=3)


@pytest.mark.parametrize("sink", [False, True])
def test_fully_masked_rows_give_zeros(sink):
    case = make_case(B=2, Hq=4, Hkv=2, D=16, S=3, Q=3, lengths=[9, 6], pad=[0, 0], seed=5)
    case["mask"][0, :, 1, :] = False  # query 1 of row 0 sees nothing
    case["q_pos"][1, 0] = -1  # query 0 of row 1 precedes every cached token
    case["s_aux"] = torch.randn(4) if sink else None
    out = cpu_kernel.paged_attention_cpu(**case)
    assert torch.all(out[0, 1] == 0) and torch.all(out[1, 0] == 0)
    assert out[0, 0].abs().sum() > 0
    check(case, num_splits=2)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_sum_exp_merges_the_attention_of_two_halves_of_a_table(dtype, splits):
    """``return_lse``: attention over a table's two halves (the other half as holes), merged by their log-sum-exp,
    is attention over the whole table, and the output is bit-identical to a call that does not ask for it."""
    case = make_case(B=3, Hq=6, Hkv=2, D=16, S=4, Q=2, lengths=[37, 9, 22], pad=[0, 2, 0], seed=3, dtype=dtype)
    case["query"] = case["query"].float()
    whole, lse = cpu_kernel.paged_attention_cpu(**case, num_splits=splits, return_lse=True)
    assert torch.equal(whole, cpu_kernel.paged_attention_cpu(**case, num_splits=splits))
    table, cut = case["page_table"], case["page_table"].shape[1] // 2
    halves = []
    for keep in (slice(0, cut), slice(cut, None)):
        part = table.clone()
        part[:, keep] = -1
        halves.append(cpu_kernel.paged_attention_cpu(**dict(case, page_table=part), num_splits=splits,
                                                     return_lse=True))
    (out1, lse1), (out2, lse2) = halves
    torch.testing.assert_close(torch.logaddexp(lse1, lse2), lse, rtol=1e-5, atol=1e-5)
    w1, w2 = (torch.exp(x - lse).nan_to_num().unsqueeze(-1) for x in (lse1, lse2))
    torch.testing.assert_close(out1 * w1 + out2 * w2, whole, rtol=1e-5, atol=1e-5)
    plain, plain_lse = cpu_kernel.plain_attention_cpu(case["query"], case["k_pool"], case["v_pool"], table,
                                                      case["page_pos"], case["q_pos"], case["scale"],
                                                      return_lse=True)
    case["mask"] = None
    out, want = cpu_kernel.paged_attention_cpu(**case, return_lse=True)
    assert torch.equal(plain, out) and torch.equal(plain_lse, want)


def test_log_sum_exp_of_a_row_that_attends_nothing_is_minus_infinity():
    case = make_case(B=2, Hq=4, Hkv=2, D=16, S=3, Q=3, lengths=[9, 6], pad=[0, 0], seed=5)
    case["mask"][0, :, 1, :] = False  # query 1 of row 0 sees nothing
    _, lse = cpu_kernel.paged_attention_cpu(**case, return_lse=True)
    assert torch.all(lse[0, 1] == -torch.inf) and torch.isfinite(lse[0, 0]).all()


def test_bad_input_is_refused_with_a_reason():
    case = make_case(B=1, Hq=4, Hkv=2, D=8, S=4, Q=1, lengths=[5], seed=8)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        cpu_kernel.paged_attention_cpu(**dict(case, k_pool=case["k_pool"].half(), v_pool=case["v_pool"].half()))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        cpu_kernel.paged_attention_cpu(**dict(case, query=case["query"][:, :3]))
    with pytest.raises(ValueError, match="unit stride"):
        cpu_kernel.paged_attention_cpu(**dict(case, k_pool=case["k_pool"].transpose(1, 3).contiguous().transpose(1, 3)))


def test_pools_checked_once_are_checked_again_when_they_change():
    """The checked pool fields a call keeps on ``k_pool`` serve only the same pool tensors: another value pool (the
    same shape, other values) is read, one of another shape or dtype is refused, and pools resized in place are
    checked again."""
    case = make_case(B=2, Hq=4, Hkv=2, D=16, S=4, Q=1, lengths=[9, 6], seed=9)
    check(case)
    other = dict(case, v_pool=torch.randn_like(case["v_pool"]))
    check(other)
    with pytest.raises(ValueError, match="k_pool/v_pool must be"):
        cpu_kernel.paged_attention_cpu(**dict(case, v_pool=case["v_pool"][:, :, :, :8]))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        cpu_kernel.paged_attention_cpu(**dict(case, v_pool=case["v_pool"].double()))
    grown = case["k_pool"].clone()
    check(dict(case, k_pool=grown))
    grown.resize_(grown.shape[0], grown.shape[1], grown.shape[2], 8)  # (an in-place change of the same tensor)
    with pytest.raises(ValueError, match="k_pool/v_pool must be"):
        cpu_kernel.paged_attention_cpu(**dict(case, k_pool=grown))


def test_index_checked_once_serves_only_the_calls_it_was_checked_for():
    """A table its owner marked checked (`mark_checked`, as a cache's step does) keeps its checked index fields for
    the calls that share it (a step's layers), only with the same ``page_pos``/``q_pos`` tensors and query shape:
    other positions are read, another batch is refused. An unmarked table is checked on every call, so an id its
    caller edits out of the pools is refused; an index the kernel had to convert (int32) is converted again, so its
    owner's edits count."""
    from hf_paged.kernels.arguments import mark_checked

    case = make_case(B=2, Hq=4, Hkv=2, D=16, S=4, Q=1, lengths=[9, 6], seed=10, holes=False)
    table32 = case["page_table"]
    case["page_table"] = table32.long()  # as a cache's index: int64, read in place
    mark_checked(case["page_table"], case["page_pos"], case["q_pos"], case["k_pool"].shape[0])
    check(case)
    earlier = dict(case, q_pos=case["q_pos"] - 2)  # the same table, queries two positions earlier: fewer tokens seen
    check(earlier)
    with pytest.raises(ValueError, match=r"page_table/page_pos must be \[B, N\]"):
        cpu_kernel.paged_attention_cpu(**dict(case, query=case["query"][:1]))
    unmarked = dict(case, page_table=table32.long())
    check(unmarked)
    unmarked["page_table"][0, 0] = case["k_pool"].shape[0]  # edited in place to an id the pools do not have
    with pytest.raises(ValueError, match="page_table holds page id"):
        cpu_kernel.paged_attention_cpu(**unmarked)
    mark_checked(table32, case["page_pos"], case["q_pos"], case["k_pool"].shape[0])
    check(dict(case, page_table=table32))
    table32[0, 1] = -1  # its owner edits the marked table into a hole: the next call reads the edit
    check(dict(case, page_table=table32))


def test_a_plain_call_reuses_its_checked_arguments_only_where_they_hold():
    """`plain_attention_cpu` (a cache's decode call: float pools, no mask, sinks or page mass) gives what
    `paged_attention_cpu` gives, bit for bit: on its first call, on later calls that reuse the checked arguments
    (another query, other positions, another marked table, a table edited into a hole), and where they no longer hold
    (another window or softcap, a grown pool, a wider table, an unmarked table, a bfloat16 query); an unmarked table's
    bad id and a pool changed in place are still refused."""
    from hf_paged.kernels.arguments import mark_checked

    case = make_case(B=2, Hq=4, Hkv=2, D=16, S=4, Q=1, lengths=[9, 6], seed=11, holes=False)
    case["page_table"] = case["page_table"].long()
    mark_checked(case["page_table"], case["page_pos"], case["q_pos"], case["k_pool"].shape[0])

    def same(c: dict, **options) -> None:
        full = cpu_kernel.paged_attention_cpu(**dict(c, **options))
        plain = cpu_kernel.plain_attention_cpu(c["query"], c["k_pool"], c["v_pool"], c["page_table"], c["page_pos"],
                                               c["q_pos"], c["scale"], options.get("sliding_window"),
                                               options.get("softcap"))
        assert plain.dtype == c["query"].dtype and torch.equal(plain, full)

    same(case)
    assert hasattr(case["k_pool"], "_hf_paged_cpu_plain_call")  # kept for the next call
    same(dict(case, query=torch.randn_like(case["query"])))
    same(dict(case, q_pos=case["q_pos"] - 2))
    another = case["page_table"].clone()  # another marked table of the same shape: its own pages are read
    another[0, 0] = another[1, 0]  # (a full page of row 1)
    mark_checked(another, case["page_pos"], case["q_pos"], case["k_pool"].shape[0])
    same(dict(case, page_table=another))
    case["page_table"][1, 0] = -1  # its owner edits the marked table into a hole: the next call reads the edit
    same(case)
    same(case, sliding_window=3)
    same(case, softcap=2.0)
    same(dict(case, k_pool=case["k_pool"].clone(), v_pool=case["v_pool"].clone()))
    wider = torch.cat([case["page_table"], torch.full((2, 1), -1)], dim=1)
    mark_checked(wider, case["page_pos"], case["q_pos"], case["k_pool"].shape[0])
    same(dict(case, page_table=wider, page_pos=torch.cat([case["page_pos"], case["page_pos"][:, -1:] + 4], 1)))
    same(dict(case, query=case["query"].bfloat16(), k_pool=case["k_pool"].bfloat16(),
              v_pool=case["v_pool"].bfloat16()))
    unmarked = dict(case, page_table=case["page_table"].clone())
    same(unmarked)
    unmarked["page_table"][0, 0] = case["k_pool"].shape[0]  # an id the pools do not have
    with pytest.raises(ValueError, match="page_table holds page id"):
        cpu_kernel.plain_attention_cpu(*(unmarked[k] for k in ("query", "k_pool", "v_pool", "page_table", "page_pos",
                                                               "q_pos", "scale")))
    case["k_pool"].resize_(*case["k_pool"].shape[:3], 8)  # an in-place change of the kept pool
    with pytest.raises(ValueError, match="k_pool/v_pool must be"):
        cpu_kernel.plain_attention_cpu(*(case[k] for k in ("query", "k_pool", "v_pool", "page_table", "page_pos",
                                                           "q_pos", "scale")))


@pytest.mark.parametrize("signal", ["attention", "output"])
@pytest.mark.parametrize("heads", ["mean", "max"])
def test_a_plain_call_with_usage_gives_the_page_mass_of_a_full_call(signal, heads):
    """`plain_attention_cpu` with ``usage`` (a bounded cache's decode call: the page mass reduced over the heads into
    the cache's buffer) gives the output and page mass of `paged_attention_cpu`, bit for bit, on its first call and
    on calls that reuse its arguments (another query, another buffer, another marked table); calls without usage keep
    their own arguments (no page mass written); a buffer of the wrong shape is refused as the full call refuses it."""
    from hf_paged.kernels.arguments import mark_checked

    case = make_case(B=2, Hq=4, Hkv=2, D=16, S=1, Q=1, lengths=[9, 6], seed=12, holes=False)
    case["page_table"] = case["page_table"].long()
    mark_checked(case["page_table"], case["page_pos"], case["q_pos"], case["k_pool"].shape[0])
    N = case["page_table"].shape[1]

    def same(c: dict) -> None:
        full, full_mass = cpu_kernel.paged_attention_cpu(**c, return_page_mass=True, page_mass_heads=heads,
                                                         page_mass_signal=signal)
        buffer = torch.full((2, N), float("nan"))
        out, mass = cpu_kernel.plain_attention_cpu(c["query"], c["k_pool"], c["v_pool"], c["page_table"],
                                                   c["page_pos"], c["q_pos"], c["scale"], usage=(heads, signal, buffer))
        assert mass is buffer and torch.equal(out, full) and torch.equal(mass, full_mass)

    same(case)
    same(case)
    same(dict(case, query=torch.randn_like(case["query"])))
    another = case["page_table"].flip(1).contiguous()
    mark_checked(another, case["page_pos"], case["q_pos"], case["k_pool"].shape[0])
    same(dict(case, page_table=another))
    plain = cpu_kernel.plain_attention_cpu(*(case[k] for k in ("query", "k_pool", "v_pool", "page_table", "page_pos",
                                                               "q_pos", "scale")))
    assert torch.equal(plain, cpu_kernel.paged_attention_cpu(**case))
    with pytest.raises(ValueError, match="page_mass_out must be a contiguous float32 CPU tensor"):
        cpu_kernel.plain_attention_cpu(*(case[k] for k in ("query", "k_pool", "v_pool", "page_table", "page_pos",
                                                           "q_pos", "scale")), usage=(heads, signal, torch.zeros(2, 1)))


def test_bad_quantized_input_is_refused_with_a_reason():
    """A format the kernel does not read, missing or misshapen scales, pools of another format, scales with float
    pools, an unknown format: each refused, naming what was wrong."""
    case = make_case(B=1, Hq=4, Hkv=2, D=32, S=4, Q=1, lengths=[5], seed=8)
    int4, int8 = quantize_case(case, "int4"), quantize_case(case, "int8")
    with pytest.raises(ValueError, match="CPU kernel reads kv_format 'float', 'int8', 'int4', 'int2', not 'fp8_e4m3'"):
        cpu_kernel.paged_attention_cpu(**quantize_case(case, "fp8_e4m3"))
    with pytest.raises(ValueError, match=r"k_scale of kv_format='int4' must be torch.float16 \[.*\], got none"):
        cpu_kernel.paged_attention_cpu(**dict(int4, k_scale=None))
    with pytest.raises(ValueError, match="v_scale of kv_format='int8' must be torch.float16"):
        cpu_kernel.paged_attention_cpu(**dict(int8, v_scale=int8["v_scale"].float()))
    with pytest.raises(ValueError, match="v_pool of kv_format='int4' must be torch.uint8"):
        cpu_kernel.paged_attention_cpu(**dict(int4, v_pool=int4["k_pool"]))  # key rows are wider (2 groups)
    with pytest.raises(ValueError, match="k_pool of kv_format='int4'"):
        cpu_kernel.paged_attention_cpu(**dict(int8, kv_format="int4"))
    with pytest.raises(ValueError, match="k_scale/v_scale belong to quantized pools"):
        cpu_kernel.paged_attention_cpu(**dict(case, k_scale=int8["k_scale"], v_scale=int8["v_scale"]))
    with pytest.raises(TypeError, match="kv_format='float' reads float16/bfloat16/float32 pools, got torch.int8"):
        cpu_kernel.paged_attention_cpu(**dict(int8, k_scale=None, v_scale=None, kv_format="float"))
    with pytest.raises(ValueError, match="kv_format='q4' is not a page format; choose one of 'float'"):
        cpu_kernel.paged_attention_cpu(**dict(int8, kv_format="q4"))


def test_missing_compiler_falls_back_to_torch_with_a_warning(tmp_path):
    """No compiler: the kernel says why, "auto" warns and uses the torch path, "cpu" raises."""
    code = (
        "import warnings, torch, hf_paged\n"
        "from hf_paged.backends import resolve_backend\n"
        "from hf_paged.kernels import cpu_paged_attention as k\n"
        "assert 'no C compiler' in k.unavailable_reason(), k.unavailable_reason()\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    assert resolve_backend('auto', torch.device('cpu')) == 'torch'\n"
        "assert any('unavailable' in str(x.message) for x in w)\n"
        "try:\n"
        "    resolve_backend('cpu', torch.device('cpu'))\n"
        "except ValueError as e:\n"
        "    assert 'C compiler' in str(e)\n"
        "else:\n"
        "    raise AssertionError('backend=cpu without a compiler must raise')\n"
    )
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), HF_PAGED_CACHE_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)


def test_unusable_cache_dir_builds_into_a_private_folder_with_a_warning(tmp_path, replayed_kernel_build):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code = (
        "import warnings\n"
        "from hf_paged.kernels import cpu_paged_attention as k\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    assert k.unavailable_reason() is None, k.unavailable_reason()\n"
        "assert len(w) == 1 and 'HF_PAGED_CACHE_DIR' in str(w[0].message), [str(x.message) for x in w]\n"
    )
    env = dict(os.environ, HF_PAGED_CACHE_DIR=str(blocker), **replayed_kernel_build)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)


def test_builds_into_a_fresh_cache_dir(built_kernel):
    """`conftest.built_kernel` built the kernel in a fresh process into an empty cache folder: one library, with its
    checksum record, in a private folder."""
    built = sorted(p.name for p in built_kernel.parent.glob("cpu_paged_attention-*"))
    assert built == [built_kernel.name, built_kernel.name + ".sha256"]
    assert built_kernel.parent.stat().st_mode & 0o777 == 0o700


def test_auto_backend_on_cpu_is_the_kernel():
    assert backends.resolve_backend("auto", torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt_oss"])
def test_generate_decodes_through_the_kernel(arch, monkeypatch):
    """Greedy, left-padded batch: tokens identical to DynamicCache; every decode step used the kernel."""
    calls = []
    real = cpu_kernel.paged_attention_cpu

    def counting(*args, **kw):
        calls.append(args[0].shape[2])
        return real(*args, **kw)

    monkeypatch.setattr(cpu_kernel, "paged_attention_cpu", counting)
    ref_model, model = make_pair(arch)
    inputs = left_padded_batch()
    new = 6
    want = ref_model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    cache = hf_paged.PagedCache(page_size=3, config=model.config, backend="cpu")
    got = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         **{hf_paged.CACHE_KWARG: cache})
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert calls and set(calls) == {1}
    assert len(calls) == (new - 1) * model.config.num_hidden_layers
