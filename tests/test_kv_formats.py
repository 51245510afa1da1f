"""Tests of the page formats (`hf_paged.kv_formats`): round-trip error bounds, the layer-pages interface
(grow, write, copy, gather, kernel operands, bytes), NaN/inf isolation, and the errors of bad formats."""

from __future__ import annotations

import math

import pytest
import torch

from hf_paged.errors import CacheUsageError
from hf_paged.kernels.arguments import check_paged_args
from hf_paged.kv_formats import KV_FORMATS, QuantizedPages, check_kv_format, page_format, rotation
from hf_paged.page_store import FloatPages, PageStore, make_layer_pages

QUANTIZED = ("int8", "int4", "int2", "fp8_e4m3")
PACKED = {"int4": 15, "int2": 3}  # formats of packed codes (keys per channel within a page): their largest code
S, H, D = 4, 3, 64  # page size, KV heads, head dim of most tests


def pages_of(kv_format: str, dtype=torch.float32, head_dim=D, value_dim=D, num_pages=6, page_size=S):
    """Pages of any format on the CPU (fp8 too: the CPU cannot read it in a kernel, but stores it)."""
    fmt = page_format(kv_format)
    cls = QuantizedPages if fmt.quantized else None
    pages = (cls(fmt, page_size, H, head_dim, value_dim, dtype, "cpu") if cls
             else FloatPages(page_size, H, head_dim, value_dim, dtype, "cpu"))
    pages.grow_to(num_pages)
    return pages


def tokens(n: int, dim: int = D, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    """Keys-like tokens: Gaussian, a few channels with a large offset (as RoPE'd keys have), varied magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, dim, generator=g) * scale * torch.rand(n, H, 1, generator=g).add(0.1)
    x[..., min(3, dim - 1)] += 8.0
    return x


def roundtrip(kv_format: str, x: torch.Tensor, values=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write tokens ``x`` (and ``values``) into the first slots, read them back (keys, values) [n, H, dim]."""
    pages = pages_of(kv_format, head_dim=x.shape[-1], value_dim=(x if values is None else values).shape[-1],
                     num_pages=-(-len(x) // S))
    pages.write(torch.arange(len(x)), x, x if values is None else values)
    keys, vals = pages.gather(torch.arange(pages.num_pages))
    return keys.flatten(0, 1)[: len(x)], vals.flatten(0, 1)[: len(x)]


# ------------------------------------------------------------------------------------- error bounds
def test_int8_error_is_at_most_half_a_step():
    x = tokens(40)
    keys, _ = roundtrip("int8", x)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((keys - x).abs() <= 0.5 * step * (1 + 2**-10) + 1e-7).all()
    assert (keys - x).abs().max() > 0.1 * step.min()  # it did quantize


@pytest.mark.parametrize("kv_format,dim", [("int4", 64), ("int4", 24), ("int4", 2), ("int2", 64), ("int2", 12),
                                           ("int2", 4)])
def test_packed_error_is_bounded_by_its_steps(kv_format, dim):
    """Keys, per channel within a page: each element is off by at most half its page and channel's step (plus the
    float16 rounding of the page's minimum), and the step is the channel's range / 15 (int2: / 3), rounded up to a
    float8
    (at most 1/8 more, or the smallest float8 step). Values, one rotated group a token: in the rotated basis each
    element is off by at most one step (rounding, and the zero point's rounding); rotated back, the error's
    norm is at most the norm of those steps."""
    x, v = tokens(40, dim), tokens(40, dim, seed=1)
    top = PACKED[kv_format]
    keys, values = roundtrip(kv_format, x, v)
    pages = x.unflatten(0, (-1, S))
    spread = pages.amax(1) - pages.amin(1)
    params = pages_of(kv_format, head_dim=dim, value_dim=dim, num_pages=10)
    params.write(torch.arange(40), x, v)
    low, step = params.k_scale[..., :dim].float(), params.k_scale[..., dim:].contiguous().view(torch.uint8)
    step = step.view(torch.float8_e4m3fn).float()
    assert (step <= torch.maximum(spread / top * 1.125, torch.tensor(2.0**-9)) * (1 + 1e-6)).all()
    bound = 0.5 * step[:, None] * (1 + 1e-6) + low.abs()[:, None] * 2**-11 + 1e-6
    assert ((keys - x).unflatten(0, (-1, S)).abs() <= bound).all()
    codec = page_format(kv_format).value
    groups = (v @ rotation(dim))[..., None, :]
    step = torch.maximum((groups.amax(-1) - groups.amin(-1)) / top, groups.amin(-1).abs() / 120) * (1 + 2**-10)
    assert ((values - v).norm(dim=-1) <= (step.square() * dim).sum(-1).sqrt() + 1e-5).all()
    assert codec.group_size(dim) == dim


def test_fp8_error_is_relative():
    x = tokens(40)
    keys, _ = roundtrip("fp8_e4m3", x)
    scale = x.abs().amax(-1, keepdim=True) / 448
    assert ((keys - x).abs() <= x.abs() * 2**-4 + scale * 2**-9 + 1e-6).all()


def test_rotation_is_an_exact_symmetric_orthogonal_block_hadamard():
    for dim, block in ((64, 64), (24, 8), (80, 16), (6, 2)):
        r = rotation(dim)
        torch.testing.assert_close(r @ r, torch.eye(dim), rtol=0, atol=1e-6)
        assert torch.equal(r, r.T)
        assert torch.equal(r.abs() > 0, torch.block_diag(*[torch.ones(block, block)] * (dim // block)).bool())
        assert torch.allclose(r.abs()[r != 0], torch.tensor(block**-0.5))


# --------------------------------------------------------------------------------- the interface
@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_write_gather_grow_and_copy(kv_format):
    """Tokens read back where they were written (within the format's error), unwritten pages read zeros (never
    NaN), growing keeps every page, and copy_pages moves codes and scales together (a page of large tokens
    copied over one of small tokens reads back as the large ones, exactly)."""
    pages = pages_of(kv_format, dtype=torch.bfloat16, num_pages=3)
    big, small = tokens(S, seed=2, scale=50.0), tokens(S, seed=3, scale=0.01)
    pages.write(torch.arange(S), big, big * 2)  # page 0
    pages.write(torch.arange(S, 2 * S), small, small)  # page 1
    before = pages.gather(torch.arange(3))
    assert before[0].dtype == torch.bfloat16 and before[0].shape == (3, S, H, D)
    assert torch.equal(before[0][2], torch.zeros(S, H, D, dtype=torch.bfloat16))
    tol = dict(float=0.01, int8=0.01, int4=0.12, int2=0.6, fp8_e4m3=0.07)[kv_format]
    for got, want in ((before[0][0], big), (before[1][0], 2 * big), (before[0][1], small)):
        assert (got.float() - want).norm() <= tol * want.norm()
    pages.grow_to(7)
    after = pages.gather(torch.arange(7))
    assert pages.num_pages == 7 and torch.equal(after[0][:3], before[0]) and torch.equal(after[1][:3], before[1])
    assert not after[0][3:].any() and not after[1][3:].any()
    pages.copy_pages(torch.tensor([0]), torch.tensor([1]))
    keys, values = pages.gather(torch.tensor([[1, 0]]))
    assert torch.equal(keys[0, 0], before[0][0]) and torch.equal(values[0, 0], before[1][0])


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_gather_dequantizes_only_the_pages_asked_for_in_their_shape(kv_format):
    pages = pages_of(kv_format)
    pages.write(torch.arange(6 * S), tokens(6 * S), tokens(6 * S, seed=1))
    everything = pages.gather(torch.arange(6))
    table = torch.tensor([[4, 1], [0, 0]])
    keys, values = pages.gather(table)
    assert keys.shape == (2, 2, S, H, D) and values.shape == (2, 2, S, H, D)
    assert torch.equal(keys, everything[0][table]) and torch.equal(values, everything[1][table])


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_kernel_operands_meet_the_kernels_argument_contract(kv_format):
    pages = pages_of(kv_format, num_pages=2)
    operands = pages.kernel_operands()
    assert set(operands) == {"k_pool", "v_pool", "k_scale", "v_scale", "kv_format"}
    assert operands["kv_format"] == kv_format and (operands["k_scale"] is None) == (kv_format == "float")
    query = torch.zeros(1, 2 * H, 1, D)
    table, pos = torch.tensor([[1, -1]]), torch.zeros(1, 2, dtype=torch.long)
    assert check_paged_args(query, page_table=table, page_pos=pos, q_pos=torch.tensor([[3]]), mask=None, s_aux=None,
                            **operands) is page_format(kv_format)


def test_page_bytes_meet_the_targets_against_float32():
    """Per token of a SmolLM2 head (D = 64), scales included: int8 and fp8 at most 0.27x float32, int4 at most
    0.16x in pages of 16 (its keys' parameters are per page: 0.22x in pages of 4), int2 0.092x (0.17x); the bytes
    are those of the tensors."""
    for page_size in (S, 16):
        float32 = pages_of("float", page_size=page_size).page_bytes()
        assert float32 == page_size * H * 2 * D * 4
        for kv_format, limit in (("int8", 0.27), ("fp8_e4m3", 0.27), ("int4", 0.16 if page_size == 16 else 0.23),
                                 ("int2", 0.092 if page_size == 16 else 0.17)):
            pages = pages_of(kv_format, page_size=page_size)
            tensors = (pages.k_codes, pages.k_scale, pages.v_codes, pages.v_scale)
            assert pages.page_bytes() == sum(t.nbytes for t in tensors) // pages.num_pages
            assert pages.page_bytes() / float32 <= limit, (kv_format, pages.page_bytes() / float32)
    assert pages_of("float", dtype=torch.bfloat16, page_size=16).page_bytes() == float32 // 2


# ------------------------------------------------------------------------------------- non-finite
@pytest.mark.parametrize("kv_format", QUANTIZED)
def test_nan_and_inf_stay_in_their_own_group(kv_format):  # int4's and int2's keys: the next test
    """A NaN key and an inf value in one page: the other tokens (and the other heads of those tokens) read back
    bit for bit as written without them; the NaN group reads NaN; the inf token's finite entries keep their
    scale (the inf saturates to the largest code), except in a rotated format (int4, int2), where the inf spreads
    over the row, which then holds nothing finite and reads NaN, as a float page's attention would."""
    x, v = tokens(S), tokens(S, seed=1)
    clean = roundtrip(kv_format, x, v)
    bad_x, bad_v = x.clone(), v.clone()
    bad_x[1, 0, 5] = float("nan")
    bad_v[2, 1, 7] = float("inf")
    keys, values = roundtrip(kv_format, bad_x, bad_v)
    others = [0, 3]
    if kv_format in PACKED:  # keys per channel within the page: the NaN's channel is the next test's
        keys, clean = keys.clone(), (clean[0].clone(), clean[1])
        keys[:, 0, 5] = clean[0][:, 0, 5] = 0
    assert torch.equal(keys[others], clean[0][others]) and torch.equal(values[others], clean[1][others])
    assert torch.equal(keys[2], clean[0][2]) and torch.equal(values[1], clean[1][1])
    assert torch.equal(keys[1, 1:], clean[0][1, 1:]) and torch.equal(values[2, [0, 2]], clean[1][2, [0, 2]])
    if kv_format not in PACKED:
        assert keys[1, 0].isnan().any()
    inf_row = values[2, 1]
    if kv_format in PACKED:
        assert inf_row.isnan().all()
        return
    finite = torch.ones(D, dtype=torch.bool)
    finite[7] = False
    assert torch.isfinite(inf_row).all()
    assert (inf_row[finite] - v[2, 1, finite]).abs().max() <= 0.07 * v[2, 1].abs().max()
    assert inf_row[7] == inf_row.abs().max()  # saturated at the scale of the finite entries


@pytest.mark.parametrize("kv_format", PACKED)
def test_packed_keys_leave_non_finite_entries_out_of_their_channels_range(kv_format):
    """A key channel's range within a page comes from its finite entries: a NaN, inf or -inf there leaves the
    page's other tokens as they would be without it (within half a step of what was written: they never read
    NaN or inf); +inf reads back as the range's top, -inf and NaN as its bottom; a channel with nothing finite
    reads 0."""
    x = tokens(S)
    bad = x.clone()
    bad[1, 0, 5], bad[2, 0, 5], bad[3, 0, 5] = float("nan"), float("inf"), float("-inf")
    bad[:, 1, 7] = float("nan")
    keys, _ = roundtrip(kv_format, bad)
    assert torch.isfinite(keys).all()
    assert (keys[0, 0, 5] - x[0, 0, 5]).abs() < 1e-3  # the only finite entry of its channel: a range of one value
    assert keys[2, 0, 5] == keys[0, 0, 5] == keys[1, 0, 5] == keys[3, 0, 5]  # nothing else to span
    assert (keys[:, 1, 7] == 0).all()
    fine = torch.isfinite(bad)
    steps = (x.amax(0) - x.amin(0)) / PACKED[kv_format]  # the clean page's per-channel steps, before float8 rounding
    assert ((keys - x).abs() <= 0.57 * steps + 1e-3)[fine].all()


@pytest.mark.parametrize("kv_format", ("int8", "fp8_e4m3"))
def test_a_token_with_nothing_finite_reads_nan_and_zeros_read_zero(kv_format):
    x = tokens(3)
    x[0, 2] = float("-inf")
    x[1] = 0.0
    keys, _ = roundtrip(kv_format, x)
    assert keys[0, 2].isnan().all() and torch.isfinite(keys[0, :2]).all()
    assert torch.equal(keys[1], torch.zeros(H, D))


# --------------------------------------------------------------------------------------- errors
def test_bad_formats_are_refused_before_any_work_naming_the_argument_and_the_alternatives():
    with pytest.raises(CacheUsageError, match="kv_format='q4' is not a page format; choose one of 'float', 'int8', "
                                              "'int4', 'int2', 'fp8_e4m3'"):
        make_layer_pages("q4", S, H, D, D, torch.float32, "cpu")
    with pytest.raises(CacheUsageError, match="kv_format='fp8_e4m3' cannot be read on cpu .* choose one of 'float', "
                                              "'int8', 'int4'"):
        make_layer_pages("fp8_e4m3", S, H, D, D, torch.float32, "cpu")
    with pytest.raises(CacheUsageError, match="kv_format='int4' packs 2 values a byte and needs a head_dim divisible "
                                              "by 2, the model's is 63; choose one of 'float', 'int8'$"):
        check_kv_format("int4", "cpu", 63)
    with pytest.raises(CacheUsageError, match="value_dim divisible by 2"):
        make_layer_pages("int4", S, H, D, 33, torch.float32, "cpu")
    with pytest.raises(CacheUsageError, match="cold_format='int2' packs 4 values a byte and needs a head_dim "
                                              "divisible by 4, the model's is 66; choose one of 'float', 'int8', "
                                              "'int4'$"):
        check_kv_format("int2", "cpu", 66, argument="cold_format")
    with pytest.raises(CacheUsageError, match="not a page format"):
        check_kv_format(None, "cpu", 64)
    for kv_format in ("float", "int8"):
        check_kv_format(kv_format, "cpu", 63)  # odd head dims are fine without nibbles
    check_kv_format("float", "meta", 64)


def test_make_layer_pages_builds_each_format_empty():
    for kv_format in ("float", "int8", "int4", "int2"):
        pages = make_layer_pages(kv_format, S, H, D, 32, torch.bfloat16, "cpu")
        assert pages.num_pages == 0 and pages.page_size == S and pages.dtype == torch.bfloat16
        assert isinstance(pages, FloatPages if kv_format == "float" else QuantizedPages)
        pages.grow_to(1)
        keys, values = pages.gather(torch.tensor([0]))
        assert keys.shape == (1, S, H, D) and values.shape == (1, S, H, 32)


# ---------------------------------------------------------------------- int4: keys encoded per page
def int4_pages(num_pages: int = 4, page_size: int = 8) -> QuantizedPages:
    return pages_of("int4", num_pages=num_pages, page_size=page_size)


def test_int4_a_page_written_token_by_token_ends_as_one_written_whole():
    """While a page fills, its keys are encoded again at every write from its float residual, so once full it
    holds the codes and parameters one write of all its tokens gives, bit for bit; the residual is held while
    the page is partial and is gone once the page is full and the layer writes elsewhere."""
    x, v = tokens(8, seed=4), tokens(8, seed=5)
    whole, stepwise = int4_pages(), int4_pages()
    whole.write(torch.arange(8, 16), x, v)  # page 1 in one write: no residual ever
    assert whole.residual_bytes() == 0
    for t in range(8):
        stepwise.write(torch.tensor([8 + t]), x[t:t + 1], v[t:t + 1])
        assert stepwise.residual_bytes() == 8 * H * D * 4  # partial, then just filled after holding tokens
        partial = stepwise.gather(torch.tensor([1]))[0][0, :t + 1]
        held = x[:t + 1]  # within half a step of the tokens it holds (and the float16 rounding of the minimum)
        bound = (held.amax(0) - held.amin(0)) / 30 * 1.13 + held.abs().amax(0) * 2**-11 + 2**-10
        assert ((partial - held).abs() <= bound).all()
    stepwise.write(torch.tensor([16]), x[:1], v[:1])  # the next page: page 1's residual goes
    assert stepwise.residual_bytes() == 8 * H * D * 4
    for name in ("k_codes", "k_scale", "v_codes", "v_scale"):
        assert torch.equal(getattr(stepwise, name)[1], getattr(whole, name)[1]), name


def test_int4_rewriting_the_write_that_filled_a_page_gives_the_same_page():
    """A rolled-back step that filled a page, retried: the page still has its residual, so the retry encodes it
    from the exact keys, as if the step had run once."""
    x, v = tokens(8, seed=6), tokens(8, seed=7)
    once, twice = int4_pages(), int4_pages()
    for pages in (once, twice):
        pages.write(torch.arange(5), x[:5], v[:5])
    twice.write(torch.arange(5, 8), x[5:] * 3, v[5:])  # the failed step, with other keys
    for pages in (once, twice):
        pages.write(torch.arange(5, 8), x[5:], v[5:])
    for name in ("k_codes", "k_scale"):
        assert torch.equal(getattr(once, name)[0], getattr(twice, name)[0]), name


def test_int4_a_write_into_a_full_page_without_residual_requantizes_what_it_hands_back():
    """A crop back into a page filled earlier: its remaining tokens are encoded again from what the page handed
    back (within half a new step of it), the new token from its exact key."""
    x, v = tokens(8, seed=8), tokens(8, seed=9)
    pages = int4_pages()
    pages.write(torch.arange(8), x, v)
    before = pages.gather(torch.tensor([0]))[0][0]
    new = tokens(1, seed=10)
    pages.write(torch.tensor([5]), new, new)  # slots 0-4 kept, slot 5 rewritten
    after = pages.gather(torch.tensor([0]))[0][0]
    step = pages.k_scale[0, :, D:].contiguous().view(torch.uint8).view(torch.float8_e4m3fn).float()
    held = torch.cat([before[:5], new])
    assert ((after[:6] - held).abs() <= 0.5 * step * (1 + 1e-6) + held.abs().amax(0) * 2**-11 + 1e-6).all()


def test_int4_copied_pages_take_their_residual_along():
    """Copy-on-write of a partial page: the copy continues as the original would (residual copied with the
    codes), and writing the copy leaves the original's residual alone."""
    x, v = tokens(8, seed=11), tokens(8, seed=12)
    pages, want = int4_pages(), int4_pages()
    pages.write(torch.arange(3), x[:3], v[:3])
    pages.copy_pages(torch.tensor([0]), torch.tensor([2]))
    pages.write(torch.arange(19, 24), x[3:], v[3:])  # the copy (page 2) fills
    pages.write(torch.arange(3, 8), x[3:] * 2, v[3:])  # the original (page 0) fills otherwise
    want.write(torch.arange(8), x, v)
    for name in ("k_codes", "k_scale", "v_codes", "v_scale"):
        assert torch.equal(getattr(pages, name)[2], getattr(want, name)[0]), name
    want.write(torch.arange(8), torch.cat([x[:3], x[3:] * 2]), v)
    assert torch.equal(pages.k_codes[0], want.k_codes[0]) and torch.equal(pages.k_scale[0], want.k_scale[0])


def test_int4_a_page_written_from_a_prefix_store_drops_its_stale_residual():
    """A page id that held a partial page (and its residual) takes a full page from a prefix store: the residual
    is dropped (a later write into the page starts from what the stored page hands back, not the old tokens)."""
    stores = [PageStore(page_size=S, kv_format="int4") for _ in range(2)]
    layers = [store.create(0, torch.zeros(1, H, 1, D), torch.zeros(1, H, 1, D)) for store in stores]
    for layer in layers:
        layer.grow_to(2)
    layers[0].write(torch.arange(2), tokens(2, seed=13), tokens(2, seed=14))  # page 0: partial, a residual
    layers[1].write(torch.arange(S), tokens(S, seed=15), tokens(S, seed=16))  # page 0: full, as a store holds it
    stores[0].write_pages(torch.tensor([0]), [0], stores[1].read_pages(torch.tensor([0]), [0]), num_pages=2)
    assert stores[0].residual_bytes() == 0
    for got, want in zip(layers[0].gather(torch.tensor([0])), layers[1].gather(torch.tensor([0]))):
        assert torch.equal(got, want)
