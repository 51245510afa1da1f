"""The C kernel reads a two-tier layer (`hf_paged.demotion.MixedPages`: hot float pages and cold int8 / int4 / int2
pages, a `ColdTier` with the row maps) in place, as the float64 reference defines it; the reference's two-tier read is
the layer's own gather. (Triton: tests/test_triton_kernel.py; generate: tests/test_demotion.py.)"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import KERNEL_CASES, assert_matches_reference, make_case, two_tier_case

from hf_paged.kernels import cpu_paged_attention as cpu_kernel
from hf_paged.kernels.reference import paged_attention_reference
from hf_paged.kv_formats import page_format

pytestmark = [pytest.mark.skipif(cpu_kernel.unavailable_reason() is not None,
                                 reason=f"CPU kernel unavailable: {cpu_kernel.unavailable_reason()}"),
              pytest.mark.usefixtures("one_thread")]
COLD_FORMATS = ("int8", "int4", "int2")


def _shape(name: str) -> dict:
    shape = dict(KERNEL_CASES[name])  # float16 pools (the C kernel reads float32 / bfloat16) run in float32
    shape["dtype"] = torch.float32 if shape.get("dtype") == torch.float16 else shape.get("dtype", torch.float32)
    return shape


@pytest.mark.parametrize("cold", COLD_FORMATS)
def test_the_reference_reads_a_two_tier_layer_as_its_gather(cold):
    """The reference's two-tier read (ids mapped to rows of either tier, cold rows dequantized) is the plain
    reference over the layer's gathered pages: the oracle of the kernel tests is the layer's own read."""
    case, layer = two_tier_case(make_case(seed=2, **_shape("gqa-page3-chunk-leftpad-fp32")), cold, seed=3)
    assert len(layer.cold_row[layer.cold_row >= 0]) and len(layer.hot_row[layer.hot_row >= 0])
    keys, values = layer.gather(torch.arange(layer.num_pages))
    plain = {k: v for k, v in case.items() if k not in ("k_pool", "v_pool", "k_scale", "v_scale", "kv_format", "cold")}
    out, mass = paged_attention_reference(**case, return_page_mass=True)
    want, want_mass = paged_attention_reference(**plain, k_pool=keys.double(), v_pool=values.double(),
                                                return_page_mass=True)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(mass, want_mass, rtol=0, atol=1e-6)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", list(KERNEL_CASES))
@pytest.mark.parametrize("cold", COLD_FORMATS)
@pytest.mark.parametrize("share", [0.5, 1.0])
def test_two_tier_pages_match_reference(cold, name, splits, share):
    """The shared cases (page sizes 1, 3, 4 and 16, odd page counts, partial pages, holes, an evicted page, batches,
    GQA/MQA, masks, a window, softcaps, sinks, page mass) with a random half (or all) of the pages cold,
    interleaved with the hot ones in every row, in rows of their own order in each tier."""
    case, _ = two_tier_case(make_case(seed=4, **_shape(name)), cold, seed=splits, cold_share=share)
    out, mass = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, num_splits=splits)
    assert out.dtype == case["query"].dtype and torch.isfinite(out).all()
    assert_matches_reference(case, out, mass, mass_tol=1e-5)


@pytest.mark.parametrize("cold", COLD_FORMATS)
@pytest.mark.parametrize("D", [8, 24, 48, 80])
def test_two_tier_head_dims(cold, D):
    """Head dims a multiple of 16 read 16 lanes at a time (int4 keys: a group of 16 a block), others element by
    element (int4 keys in groups of gcd(D, 16))."""
    case, _ = two_tier_case(make_case(B=2, Hq=6, Hkv=3, D=D, S=1, Q=2, lengths=[75, 41], pad=[3, 0], seed=D), cold,
                            seed=D)
    out, mass = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, num_splits=2)
    assert_matches_reference(case, out, mass, mass_tol=1e-5)


@pytest.mark.parametrize("cold", COLD_FORMATS)
def test_output_signal_of_two_tier_pages(cold):
    """The output signal compares each token's value with the output in its tier's basis (int4: cold values are
    rotated, hot ones are not)."""
    case, _ = two_tier_case(make_case(B=2, Hq=9, Hkv=3, D=48, S=1, Q=2, lengths=[40, 23], pad=[0, 3], seed=3,
                                      dtype=torch.bfloat16), cold, seed=5)
    _, want = paged_attention_reference(**case, return_page_mass=True, page_mass_signal="output")
    for splits in (1, 3):
        _, moved = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, num_splits=splits,
                                                  page_mass_signal="output")
        torch.testing.assert_close(moved, want, rtol=1e-4, atol=1e-5)


def test_an_id_holding_nothing_is_a_hole():
    """A page id with a row in neither tier (freed) is skipped, as -1 is."""
    case, layer = two_tier_case(make_case(seed=6, **_shape("mha-page1-decode-fp32")), "int4", seed=6)
    page = int(case["page_table"][0][case["page_table"][0] >= 0][0])
    layer.forget_residuals([page])
    case = {**case, **layer.kernel_operands()}
    out, mass = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True)
    holed = dict(case, page_table=case["page_table"].masked_fill(case["page_table"] == page, -1))
    torch.testing.assert_close(out, paged_attention_reference(**holed), rtol=1e-5, atol=1e-6)
    assert_matches_reference(case, out, mass, mass_tol=1e-5)


def test_bad_two_tier_input_is_refused_with_a_reason():
    case, _ = two_tier_case(make_case(seed=7, **_shape("mha-page1-decode-fp32")), "int8", seed=7)
    cold = case["cold"]
    rows = cold.cold_row.clone()
    rows[rows.argmax()] = cold.k_pool.shape[0]
    with pytest.raises(ValueError, match=r"ColdTier.cold_row holds rows outside \[-1, "):
        cpu_kernel.paged_attention_cpu(**dict(case, cold=type(cold)(**{**vars(cold), "cold_row": rows})))
    with pytest.raises(ValueError, match="ColdTier.hot_row must be a contiguous int64"):
        cpu_kernel.paged_attention_cpu(**dict(case, cold=type(cold)(**{**vars(cold), "hot_row": cold.hot_row[:-1]
                                                                        .int()})))
    with pytest.raises(ValueError, match="pairs float hot pools with quantized cold ones"):
        cpu_kernel.paged_attention_cpu(**dict(case, cold=type(cold)(**{**vars(cold), "format": page_format("float")})))


def test_a_cold_tier_is_checked_once_and_its_row_maps_at_every_call():
    """A two-tier layer's pools and formats are checked at the first call and kept (its `ColdTier` is made anew at
    every call), but its row maps' values, which change as pages move between tiers, at every call."""
    case, _ = two_tier_case(make_case(seed=8, **_shape("mha-page1-decode-fp32")), "int8", seed=8)
    want = cpu_kernel.paged_attention_cpu(**case)
    cold = case["cold"]
    row = int(cold.cold_row.argmax())
    held = int(cold.cold_row[row])
    cold.cold_row[row] = cold.k_pool.shape[0]  # in place (the same tensor): a row past the cold pools
    with pytest.raises(ValueError, match=r"ColdTier.cold_row holds rows outside \[-1, "):
        cpu_kernel.paged_attention_cpu(**dict(case, cold=type(cold)(**vars(cold))))
    cold.cold_row[row] = held
    torch.testing.assert_close(cpu_kernel.paged_attention_cpu(**dict(case, cold=type(cold)(**vars(cold)))), want,
                               rtol=0, atol=0)
