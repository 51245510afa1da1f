"""Quantized pages (issue 32): what each page format costs in perplexity and bytes, and its decode speed.

The study behind scripts/quantized.py (which documents both parts and the arguments): `perplexity_part` scores
the embedded text through `SimulatedPages`, a DynamicCache that keeps what each page `Scheme` hands back;
`speed_part` times the C kernel's decode call on one SmolLM2-shaped layer with pages of each format; `cache_part`
measures the real caches with quantized pages (`PagedCache(kv_format=...)`): KV bytes per token from ``stats()`` and
perplexity; `agreement_part` the greedy agreement of `generate_many` (``kv_format``, ``cold_format``) with float pages
over the many-prompts workload; `decode_part` ``generate``'s decode speed; `mixed_part` the decode speed of a
mixed-precision cache (``cold_format="int4"``).
"""

from __future__ import annotations

import gc
import itertools
import math
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache

from .. import assets
from ..kv_formats import KEY_GROUP, PackedCodec, QuantizedPages, dequantize, page_format, quantize
from ..model_config import CACHE_KWARG
from ..page_store import FloatPages
from ..stats import GenerationStats
from .formats import pyplot, write_report
from .intervals import paired_ratio_interval
from .memory import MemoryMeter, _libc
from .nll import CacheStream
from .run_info import load_average, versions
from .text import load_token_ids

PARTS = ("perplexity", "speed", "cache", "agreement", "decode", "mixed")
CACHE_FORMATS = ("float", "int8", "int4", "int2")  # the formats the CPU reads, through the real caches
COLD = "int4 cold pages (sinks, newest page float)"  # PagedCache(cold_format="int4"): pages demoted as they fill
SPEED_FORMATS = ("float32", "bfloat16", "int8", "int4", "float32+int4")  # the last: two tiers, 7 of 8 pages cold
COLD_SHARE = 8  # "float32+int4": every page but each 8th is cold (a cache at a quarter of the context's bytes)
LAYER = dict(query_heads=9, kv_heads=3, head_dim=64)  # one SmolLM2-135M layer
TARGETS = {"int8": (0.27, 0.1), "int4": (0.16, 1.5)}  # issue 32: bytes / float32's at most, perplexity +% at most
DEFAULTS = dict(max_tokens=2048, contexts="1024,4096,16384", batches="1,8", repeats=9, calls=20,
                cache_tokens="2048,8192", decode_contexts="1024,4096,16384", decode_batches="1,8", decode_tokens=16,
                num_prompts=16, peer_bits="4,2", peer_residual=128, mixed_budget=0.25)
QUICK = dict(max_tokens=256, contexts="256,1024", batches="1,2", repeats=3, calls=3, cache_tokens="256",
             decode_contexts="128,256", decode_batches="1,2", decode_tokens=4, num_prompts=4, peer_bits="4,2",
             peer_residual=128, mixed_budget=0.25)
MIXED_ENTRIES = ("float", "bounded float", "mixed int4", "mixed int4, torch path")  # part "mixed"
AGREEMENT_ENTRIES = {"float": {}, "int8": dict(kv_format="int8"), "int4": dict(kv_format="int4"),  # part "agreement"
                     "cold int8": dict(cold_format="int8"), "cold int4": dict(cold_format="int4")}


# ------------------------------------------------------------------------------------------ schemes
@dataclass(frozen=True)
class Scheme:
    """How a page scheme hands keys and values back (``[..., T, D]`` -> same), and its bytes per token and KV
    head, keys and values together, scales included."""

    name: str
    keys: Callable[[torch.Tensor], torch.Tensor]
    values: Callable[[torch.Tensor], torch.Tensor]
    bytes_per_head: float
    note: str = ""
    page_size: int = 0  # > 0: ``keys`` maps a layer's whole key history (pages of this size), not new keys alone
    first_tokens: int = 0  # > 0 (with page_size): the first tokens' keys and values read back as ``first_read``
    first_read: Callable[[torch.Tensor], torch.Tensor] | None = None  # makes them (e.g. the attention sinks exact)


def codec_roundtrip(codec) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a page of ``codec`` reads back of ``x [..., D]``."""
    return lambda x: dequantize(codec, *quantize(codec, x), x.shape[-1]).to(x.dtype)


def codec_bytes(codec, dim: int) -> int:
    """Bytes of one token's row of one head in ``codec``: codes, then float16 scales."""
    return codec.width(dim) * torch.empty((), dtype=codec.dtype).element_size() + 2 * codec.groups(dim)


def page_keys_roundtrip(codec, page_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """What pages of a per-page key codec (int4's) hand back of a layer's keys ``[B, H, T, D]``: pages of
    ``page_size`` positions from position 0, each encoded over the tokens it holds (the last, partial page too)."""
    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        B, H, T, D = x.shape
        pages = -(-T // page_size)
        padded = torch.nn.functional.pad(x.float(), (0, 0, 0, pages * page_size - T))
        slots = padded.unflatten(2, (pages, page_size)).permute(0, 2, 3, 1, 4).flatten(0, 1)  # [B * pages, S, H, D]
        valid = (torch.arange(pages * page_size, device=x.device) < T).view(pages, page_size).repeat(B, 1)
        back = codec.decode_pages(*codec.encode_pages(slots, valid), D)
        return back.unflatten(0, (B, pages)).permute(0, 3, 1, 2, 4).flatten(2, 3)[:, :, :T].to(x.dtype)
    return roundtrip


def kivi_keys(page_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """KIVI's keys: each full page of ``page_size`` tokens quantized per channel to 4 bits (asymmetric, float16
    scale and minimum per channel and page), the partial last page left as it is."""
    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        full = x.shape[-2] // page_size * page_size
        pages = x[..., :full, :].float().unflatten(-2, (-1, page_size))
        low = pages.amin(-2, keepdim=True).half().float()
        scale = ((pages.amax(-2, keepdim=True) - low) / 15).half().float()
        scale = torch.where(scale > 0, scale, 1.0)
        quantized = ((pages - low) / scale).round().clamp(0, 15) * scale + low
        return torch.cat([quantized.flatten(-3, -2).to(x.dtype), x[..., full:, :]], -2)
    return roundtrip


def schemes(head_dim: int, page_size: int, tokens: int = 2048) -> list[Scheme]:
    """float32 (the reference), bfloat16, the formats, and the int4 alternatives (module docstring); a scheme that
    keeps the first page otherwise counts its bytes over ``tokens`` tokens."""
    same = lambda x: x  # noqa: E731
    bf16 = lambda x: x.to(torch.bfloat16).to(x.dtype)  # noqa: E731
    int8, int4 = page_format("int8"), page_format("int4")

    def of(name, key, value, note=""):
        return Scheme(name, codec_roundtrip(key), codec_roundtrip(value),
                      codec_bytes(key, head_dim) + codec_bytes(value, head_dim), note)

    value_bytes = codec_bytes(int4.value, head_dim)
    int4_bytes = head_dim / 2 + 2 * int4.key.params_width(head_dim) / page_size + value_bytes
    token_keys = PackedCodec(KEY_GROUP)  # int4's keys before they went per channel within a page
    int8_first = codec_bytes(int8.key, head_dim) + codec_bytes(int8.value, head_dim)

    def first_page(name, first_read, first_bytes):  # int4 with the first page (attention sinks) stored otherwise
        return Scheme(name, page_keys_roundtrip(int4.key, page_size), codec_roundtrip(int4.value),
                      int4_bytes + page_size * (first_bytes - int4_bytes) / tokens,
                      f"bytes over {tokens} tokens", page_size, page_size, first_read)

    return [
        Scheme("float32", same, same, 2 * 4 * head_dim, "the reference"),
        Scheme("bfloat16", bf16, bf16, 2 * 2 * head_dim),
        of("int8", int8.key, int8.value, "the format"),
        Scheme("int4", page_keys_roundtrip(int4.key, page_size), codec_roundtrip(int4.value), int4_bytes,
               "the format", page_size),
        first_page("int4, first page float32 (attention sinks)", same, 2 * 4 * head_dim),
        first_page("int4, first page bfloat16", bf16, 2 * 2 * head_dim),
        first_page("int4, first page int8", codec_roundtrip(int8.key), int8_first),
        Scheme("int4, values per token in groups of 32", page_keys_roundtrip(int4.key, page_size),
               codec_roundtrip(PackedCodec(32)), int4_bytes - value_bytes + codec_bytes(PackedCodec(32), head_dim), "",
               page_size),
        of("int4, keys per token in groups of 16", token_keys, int4.value),
        of("int4, keys per token, not rotated", PackedCodec(KEY_GROUP, rotated=False), int4.value),
        of("int4, keys per token in groups of 32", PackedCodec(32), int4.value),
        of("int4, keys per token, one group a head", PackedCodec(None), int4.value),
        of("int4, keys per token, values not rotated", token_keys, PackedCodec(None, rotated=False)),
        Scheme(f"int4, KIVI keys (per channel, pages of {page_size})", kivi_keys(page_size),
               codec_roundtrip(int4.value), head_dim / 2 + 2 * 2 * head_dim / page_size + value_bytes,
               "needs a page-fill event and a float residual page"),
    ]


class SimulatedPages(DynamicCache):
    """A DynamicCache that keeps what pages of ``scheme`` would hand back: new keys and values go through the
    scheme before they are stored, so attention reads them as it would read such pages. A scheme of per-page keys
    keeps every layer's exact keys, all of them (no sliding-window layers: a page's codes depend on every token
    it holds, also those a window no longer attends; the model's masks still apply the window), and hands back
    their pages' roundtrip."""

    def __init__(self, scheme: Scheme, **kwargs):
        if scheme.page_size:
            kwargs.pop("config", None)
        super().__init__(**kwargs)
        self.scheme = scheme

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        scheme = self.scheme
        if not scheme.page_size:
            return super().update(scheme.keys(key_states), scheme.values(value_states), layer_idx, *args, **kwargs)
        values, first = scheme.values(value_states), scheme.first_tokens - self.get_seq_length(layer_idx)
        if first > 0:  # new tokens among the first first_tokens: their values as first_read keeps them
            values = torch.cat([scheme.first_read(value_states[..., :first, :]), values[..., first:, :]], -2)
        keys, values = super().update(key_states, values, layer_idx, *args, **kwargs)
        read = scheme.keys(keys)  # the exact keys are kept: their pages are encoded as they fill
        if scheme.first_tokens:
            first = scheme.first_tokens
            read = torch.cat([scheme.first_read(keys[..., :first, :]), read[..., first:, :]], -2)
        return read, values


# --------------------------------------------------------------------------------------- perplexity
@torch.no_grad()
def log_probs(model, ids: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """float32 log-probabilities ``[T - 1, V]`` of every next token, one forward through `SimulatedPages`."""
    cache = SimulatedPages(scheme, config=model.config)
    logits = model(input_ids=ids[None], use_cache=True, **{CACHE_KWARG: cache}).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def perplexity_part(args, progress) -> dict:
    model, tokenizer = assets.load_model_and_tokenizer(args.model, dtype=torch.float32, attn_implementation="sdpa")
    ids, info = load_token_ids(tokenizer, args.max_tokens)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = config.num_hidden_layers * config.num_key_value_heads
    rows, reference = [], None
    bar = progress(total=len(schemes(head_dim, args.page_size, len(ids))), desc="page schemes")
    for scheme in schemes(head_dim, args.page_size, len(ids)):
        t0 = time.perf_counter()
        logp = log_probs(model, ids, scheme)
        nll = -logp.gather(-1, ids[1:, None])[:, 0].double()
        row = dict(name=scheme.name, note=scheme.note, tokens=len(nll), perplexity=math.exp(float(nll.mean())),
                   bytes_per_token=scheme.bytes_per_head * heads,
                   block_nll=[float(nll[s:s + args.block].sum()) for s in range(0, len(nll), args.block)])
        if reference is None:
            reference, ref_row = logp, row
        kl = (reference.exp() * (reference - logp)).sum(-1)
        ratio, low, high = paired_ratio_interval(row["block_nll"], ref_row["block_nll"], _blocks(len(nll), args.block))
        row.update(kl_mean=float(kl.mean()), kl_p99=float(kl.quantile(0.99)),
                   top1_agreement=float((logp.argmax(-1) == reference.argmax(-1)).float().mean()),
                   relative=ratio, low=low, high=high, bytes_ratio=row["bytes_per_token"] / ref_row["bytes_per_token"],
                   wall_s=time.perf_counter() - t0)
        rows.append(row)
        bar.update(1)
    bar.close()
    return dict(text=info, head_dim=head_dim, kv_heads_all_layers=heads, rows=rows)


# -------------------------------------------------------------------------------------------- speed
def layer_pages(name: str, num_pages: int, page_size: int):
    """Empty pages of one SmolLM2 layer in a `SPEED_FORMATS` entry, grown to ``num_pages``."""
    shape = (page_size, LAYER["kv_heads"], LAYER["head_dim"], LAYER["head_dim"])
    if name in ("float32", "bfloat16"):
        pages = FloatPages(*shape, getattr(torch, name), "cpu")
    elif "+" in name:  # a two-tier layer (`hf_paged.demotion.MixedPages`), demoted once written (`speed_part`)
        from ..demotion import ColdPages

        pages = ColdPages(name.partition("+")[2], page_size).make_layer(0, *shape, torch.float32, "cpu")
    else:
        pages = QuantizedPages(page_format(name), *shape, torch.float32, "cpu")
    pages.grow_to(num_pages)
    return pages


def _layer_bytes(pages, num_pages: int, cold: int) -> int:
    """Bytes of ``num_pages`` pages of a `layer_pages` layer, ``cold`` of them cold in a two-tier one."""
    if hasattr(pages, "cold_page_bytes"):
        return (num_pages - cold) * pages.hot_page_bytes + cold * pages.cold_page_bytes
    return pages.page_bytes() * num_pages


def time_calls(call: Callable[[], object], calls: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per call, over ``calls`` calls."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        call()
    return (time.process_time() - cpu) / calls, (time.perf_counter() - wall) / calls


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def speed_part(args, progress) -> dict:
    from hf_paged.kernels import cpu_paged_attention as kernel
    from hf_paged.kernels.arguments import mark_checked

    if kernel.unavailable_reason():
        raise SystemExit(f"the C kernel is unavailable: {kernel.unavailable_reason()}")
    S, Hq, D = args.page_size, LAYER["query_heads"], LAYER["head_dim"]
    results = []
    configs = list(itertools.product(args.contexts, args.batches))
    bar = progress(total=len(configs) * args.repeats, desc="decode calls")
    for context, batch in configs:
        per_row = math.ceil(context / S)
        g = torch.Generator().manual_seed(context + batch)
        table = torch.arange(batch * per_row).view(batch, per_row)
        page_pos = (torch.arange(per_row) * S).expand(batch, per_row).contiguous()
        q_pos = torch.full((batch, 1), context - 1)
        mark_checked(table, page_pos, q_pos, batch * per_row)  # as a cache step does, once for every layer
        query = torch.randn(batch, Hq, 1, D, generator=g)
        pools = {}
        for name in SPEED_FORMATS:
            pools[name] = layer_pages(name, batch * per_row, S)
        for start in range(0, batch * per_row * S, 1 << 16):  # the same tokens in every format
            slots = torch.arange(start, min(start + (1 << 16), batch * per_row * S))
            keys = torch.randn(len(slots), LAYER["kv_heads"], D, generator=g) + torch.linspace(-3, 3, D)
            values = torch.randn(len(slots), LAYER["kv_heads"], D, generator=g)
            for pages in pools.values():
                pages.write(slots, keys, values)
        cold = np.flatnonzero(np.arange(batch * per_row) % COLD_SHARE != 0)
        pools["float32+int4"].demote(cold)  # (every slot written: demoted pages are full)
        calls = {name: (lambda p=pages: kernel.paged_attention_cpu(query, **p.kernel_operands(), page_table=table,
                                                                   page_pos=page_pos, q_pos=q_pos, scale=D**-0.5))
                 for name, pages in pools.items()}
        for call in calls.values():
            call()  # warm-up
        times = {name: [] for name in SPEED_FORMATS}
        for round_ in range(args.repeats):
            order = SPEED_FORMATS[round_ % len(SPEED_FORMATS):] + SPEED_FORMATS[:round_ % len(SPEED_FORMATS)]
            for name in order:
                times[name].append(time_calls(calls[name], args.calls))
            bar.update(1)
        for name in SPEED_FORMATS:
            cpu = [c for c, _ in times[name]]
            ratios = [c / f for (c, _), (f, _) in zip(times[name], times["float32"])]
            q1, median, q3 = quartiles(ratios)
            results.append(dict(context=context, batch=batch, format=name, cpu_ms=1e3 * statistics.median(cpu),
                                wall_ms=1e3 * statistics.median(w for _, w in times[name]),
                                cpu_ratio=median, cpu_ratio_q1=q1, cpu_ratio_q3=q3,
                                kv_bytes=_layer_bytes(pools[name], batch * per_row, len(cold))))
        del pools, calls
    bar.close()
    return dict(layer=LAYER, page_size=S, threads=torch.get_num_threads(), calls=args.calls, repeats=args.repeats,
                results=results)


# ------------------------------------------------------------------------------------- the real caches
def _paged(model, page_size: int, name: str):
    """An empty `PagedCache` for a cache part entry: a ``CACHE_FORMATS`` page format, or `COLD`."""
    import hf_paged

    formats = dict(cold_format="int4") if name == COLD else dict(kv_format=name)
    return hf_paged.PagedCache(page_size=page_size, config=model.config, **formats)


def _bytes_per_token(model, ids: torch.Tensor, page_size: int, name: str) -> float:
    """``stats()["kv_bytes"]`` of a `_paged` cache after a prefill of ``ids``, per token (`COLD`: its full pages
    demoted but the sinks, as the prefill's commit leaves them)."""
    import hf_paged

    cache = _paged(model, page_size, name)
    with torch.no_grad():
        model(input_ids=ids[None], use_cache=True, **{hf_paged.CACHE_KWARG: cache})
    return cache.stats()["kv_bytes"] / len(ids)


def _first_divergence(got: list[int], want: list[int]) -> int:
    """Tokens of ``got`` equal to ``want`` before the first that differs."""
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def _blocks(count: int, block: int) -> list[int]:
    """The sizes of the blocks of ``block`` tokens (the last one shorter) that ``count`` scored tokens make."""
    return [min(block, count - b) for b in range(0, count, block)]


def _scored(logp: torch.Tensor, ids: torch.Tensor, block: int, name: str, reference: torch.Tensor | None,
            ref_row: dict | None) -> dict:
    """A perplexity row of ``logp [T - 1, V]`` for the next tokens of ``ids``: per-block NLL sums, and against
    ``reference`` (float pages' log-probabilities, ``ref_row`` their row; None: this is the reference) the paired
    interval of the perplexity ratio, mean KL divergence and top-1 agreement (computed in slices to bound memory)."""
    nll = -logp.gather(-1, ids[1:, None])[:, 0].double()
    row = dict(name=name, tokens=len(ids), perplexity=math.exp(float(nll.mean())),
               block_nll=[float(nll[b:b + block].sum()) for b in range(0, len(nll), block)])
    if reference is None:
        return dict(row, relative=0.0, low=0.0, high=0.0, kl_mean=0.0, top1_agreement=1.0)
    kl, top1 = 0.0, 0
    for s in range(0, len(logp), 1024):
        ref, got = reference[s:s + 1024], logp[s:s + 1024]
        kl += float((ref.exp() * (ref - got)).sum())
        top1 += int((got.argmax(-1) == ref.argmax(-1)).sum())
    ratio, low, high = paired_ratio_interval(row["block_nll"], ref_row["block_nll"], _blocks(len(nll), block))
    return dict(row, relative=ratio, low=low, high=high, kl_mean=kl / len(logp), top1_agreement=top1 / len(logp))


def _peer_models(args):
    """(the float32 "sdpa" model QuantizedCache and the simulated bfloat16 pages run on, the peer's bit widths, why
    the peer is skipped or None)."""
    from . import quantized_peer as peer

    model, _ = assets.load_model_and_tokenizer(args.model, dtype=torch.float32, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    reason = peer.unavailable_reason()
    if reason:
        print(f"skipping the QuantizedCache rows: {reason}")
    return model, () if reason else tuple(args.peer_bits), reason


def cache_part(args, progress) -> dict:
    """Bytes and perplexity at each ``--cache-tokens`` length through `PagedCache` pages, with transformers'
    QuantizedCache (quanto) beside them where it runs."""
    import hf_paged

    from . import quantized_peer as peer

    model, tokenizer = assets.load_model_and_tokenizer(args.model, dtype=torch.float32, attn_implementation="hf_paged")
    model.generation_config.eos_token_id = None
    sdpa, bits, peer_skipped = _peer_models(args)
    ids, info = load_token_ids(tokenizer, max(args.cache_tokens))
    bar = progress(total=2 + len(args.cache_tokens) * (2 + len(CACHE_FORMATS) + len(bits)), desc="real caches")
    # KV bytes per token: float pages of a float32 and a bfloat16 model, int8, int4, int2 pages (scales included), and
    # QuantizedCache after a prefill (everything quantized) and with its float residual full
    tokens = ids[: args.page_size * max(1, min(args.cache_tokens) // (2 * args.page_size))]  # whole pages
    bf16, _ = assets.load_model_and_tokenizer(args.model, dtype=torch.bfloat16, attn_implementation="hf_paged")
    sizes = {"float32": _bytes_per_token(model, tokens, args.page_size, "float"),
             "bfloat16": _bytes_per_token(bf16, tokens, args.page_size, "float")}
    del bf16
    bar.update(1)
    for name in (*CACHE_FORMATS[1:], COLD):
        sizes[name] = _bytes_per_token(model, tokens, args.page_size, name)
    peer_sizes = {}
    for nbits in bits:
        name = peer.name(nbits, args.peer_residual)
        peer_sizes[name] = peer.bytes_per_token(sdpa, tokens, nbits, args.peer_residual)
        sizes[name] = peer_sizes[name]["prefilled"]
    bar.update(1)
    # perplexity at each length: float pages (the reference), bfloat16 keys and values (simulated), int8, int4, int2
    # pages in one forward, QuantizedCache in chunks of its residual and `COLD` in chunks of a page (each token's
    # decoding view), `COLD` also paired with QuantizedCache int4
    bf16_scheme = next(s for s in schemes(64, args.page_size) if s.name == "bfloat16")
    perplexity = []
    for length in args.cache_tokens:
        text, rows, reference, ref_row = ids[:length], [], None, None

        def add(name, logp, bytes_per_token=None):
            nonlocal reference, ref_row
            row = _scored(logp, text, args.block, name, reference, ref_row)
            if reference is None:
                reference, ref_row = logp, row
            rows.append(dict(row, bytes_per_token=bytes_per_token or sizes.get(name),
                             wall_s=time.perf_counter() - t0))
            bar.update(1)

        for kv_format in CACHE_FORMATS:
            t0 = time.perf_counter()
            cache = hf_paged.PagedCache(page_size=args.page_size, config=model.config, kv_format=kv_format)
            with torch.no_grad():
                logits = model(input_ids=text[None], use_cache=True, **{hf_paged.CACHE_KWARG: cache}).logits[0, :-1]
            del cache
            add("float32" if kv_format == "float" else kv_format, torch.log_softmax(logits, dim=-1))
            del logits
            if kv_format == "float":
                t0 = time.perf_counter()
                add("bfloat16", log_probs(sdpa, text, bf16_scheme))
        for nbits in bits:
            t0 = time.perf_counter()
            add(peer.name(nbits, args.peer_residual), peer.log_probs(sdpa, text, nbits, args.peer_residual))
        t0 = time.perf_counter()
        stream = CacheStream(model, _paged(model, args.page_size, COLD), hf_paged.CACHE_KWARG)
        add(COLD, stream.log_probs(text, args.page_size), stream.cache.stats()["kv_bytes"] / length)
        del stream
        rival = next((row for row in rows if row["name"] == peer.name(4, args.peer_residual)), None)
        if rival is not None:  # `COLD` against QuantizedCache int4, paired over the same blocks
            ratio = paired_ratio_interval(rows[-1]["block_nll"], rival["block_nll"], _blocks(length - 1, args.block))
            rows[-1]["vs_peer"] = dict(name=rival["name"], **dict(zip(("relative", "low", "high"), ratio)))
        perplexity.append(dict(tokens=length, rows=rows))
        del reference
    bar.close()
    return dict(text=info, page_size=args.page_size, bytes_per_token=sizes, bytes_tokens=len(tokens),
                peer_bytes=peer_sizes, peer_skipped=peer_skipped, perplexity=perplexity)


def agreement_part(args, progress) -> dict:
    """Greedy agreement with float pages over the many-prompts workload (``--num-prompts`` Britannica prompts of
    32-256 tokens, 8 or 64 new tokens each): `generate_many` on the embedded SmolLM2 (float32, "hf_paged") with each
    `AGREEMENT_ENTRIES` cache (kv_format int8/int4 pages; cold_format int8/int4: full pages but the sinks demoted
    once filled), entries in turn, ``--repeats`` rounds alternating their order. Per entry and prompt: new tokens
    before the first difference from float pages'; per entry: the peak ``kv_bytes`` of the run (after a step) and
    CPU seconds per run (``time.process_time``, medians)."""
    import types

    import hf_paged

    from .many_prompts import workload

    model, tokenizer = assets.load_model_and_tokenizer(args.model, dtype=torch.float32, attn_implementation="hf_paged")
    shape = types.SimpleNamespace(system_prompt=0, num_prompts=args.num_prompts, min_len=32, max_len=256,
                                  short_new=8, long_new=64)
    prompts, wanted = workload(tokenizer, shape)
    names = list(AGREEMENT_ENTRIES)
    outputs, peaks, cpu = {}, {}, {name: [] for name in names}
    bar = progress(total=len(names) * args.repeats, desc="agreement")
    for round_ in range(args.repeats):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            stats = PeakBytes()
            t0 = time.process_time()
            outputs[name] = hf_paged.generate_many(model, prompts, max_new_tokens=wanted, eos_token_id=[],
                                                   page_size=args.page_size, progress=False, stats=stats,
                                                   **AGREEMENT_ENTRIES[name])
            cpu[name].append(time.process_time() - t0)
            peaks[name] = stats.peak_kv_bytes
            bar.update(1)
    bar.close()
    rows = []
    for name in names:
        same = [_first_divergence(got, want) for got, want in zip(outputs[name], outputs["float"])]
        rows.append(dict(cache=name, prompts=len(prompts), wanted=wanted, tokens_before_divergence=same,
                         equal=sum(s == n for s, n in zip(same, wanted)), median=statistics.median(same),
                         min=min(same), agreeing_share=sum(same) / sum(wanted), peak_kv_bytes=peaks[name],
                         cpu_s=statistics.median(cpu[name]), cpu_ratio=statistics.median(
                             c / f for c, f in zip(cpu[name], cpu["float"]))))
    return dict(page_size=args.page_size, threads=torch.get_num_threads(), repeats=args.repeats, rows=rows)


class PeakBytes(GenerationStats):
    """`GenerationStats` that also keep the largest ``kv_bytes`` the run's cache held after a step."""

    peak_kv_bytes = 0

    def step(self, *, cache_stats: dict, **kwargs) -> None:
        super().step(cache_stats=cache_stats, **kwargs)
        self.peak_kv_bytes = max(self.peak_kv_bytes, cache_stats["kv_bytes"])


# ------------------------------------------------------------------------------------------ decode speed
def _prefilled_kv(model, prompt: torch.Tensor, chunk: int = 2048) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's float keys and values ``[1, H, T, D]`` of ``prompt`` (1-D), computed in chunks of ``chunk``."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for start in range(0, len(prompt), chunk):  # the decoder alone: no logits [chunk, vocab] to hold
            model.base_model(input_ids=prompt[None, start:start + chunk], use_cache=True, **{CACHE_KWARG: cache})
    return [(layer.keys, layer.values) for layer in cache.layers]


def release_memory() -> None:
    """Collect garbage and hand freed heap memory back to the OS (``malloc_trim(0)`` on glibc). glibc raises its
    mmap threshold when a large block is freed, so later tensors of a few MB come from its heap, whose freed
    holes a process keeps: a decode benchmark's resident memory then grows round by round well past what its
    caches hold (a 4k-token, batch-8 run reached 7.9 GB for about 4 GB of live tensors). Called between timed
    runs, never inside one."""
    gc.collect()
    if _libc():
        _libc().malloc_trim(0)


def _filled(cache, kv: list[tuple[torch.Tensor, torch.Tensor]], batch: int):
    """``cache`` holding ``kv`` in ``batch`` rows, written as one prefill writes them (each layer once, in order; a
    QuantizedCache quantizes them once, as its first update does); row r is offset by r/1000 so that rows differ (a
    cache may share identical rows' pages)."""
    offsets = (torch.arange(batch, dtype=kv[0][0].dtype) / 1000).view(batch, 1, 1, 1)
    with torch.no_grad():
        for layer_idx, (keys, values) in enumerate(kv):
            cache.update(keys + offsets, values + offsets, layer_idx)
    return cache


def _decode_setup(args, progress, desc: str):
    """(the float32 model with 'hf_paged' attention and no end of sequence, its tokenizer, a progress bar over the
    decode configurations and their rounds)."""
    model, tokenizer = assets.load_model_and_tokenizer(args.model, dtype=torch.float32, attn_implementation="hf_paged")
    model.generation_config.eos_token_id = None
    configs = list(itertools.product(args.decode_contexts, args.decode_batches))
    return model, tokenizer, progress(total=len(configs) * (1 + args.repeats), desc=desc)


def decode_part(args, progress) -> dict:
    """``generate``'s decode speed at each ``--decode-contexts`` length and ``--decode-batches`` size, float32, int8
    and int4 pages, int4 cold pages (`COLD`) and QuantizedCache int4/int2 holding the same keys and values, entries
    alternating."""
    import hf_paged

    from . import quantized_peer as peer

    model, tokenizer, bar = _decode_setup(args, progress, "decode through the caches")
    sdpa, bits, peer_skipped = _peer_models(args)
    peers = {peer.name(nbits, args.peer_residual): nbits for nbits in bits}
    entries = [*CACHE_FORMATS, COLD, *peers]
    meter = MemoryMeter(torch.device("cpu"))
    results = []
    for context in args.decode_contexts:
        prompt = load_token_ids(tokenizer, context)[0]
        kv = _prefilled_kv(sdpa, prompt[:-1])
        for batch in args.decode_batches:
            meter.start()  # this configuration's peak resident memory, from what the models and ``kv`` hold
            caches = {}
            for name in entries:  # each filled on its own, the memory freed while filling it handed back
                empty = (peer.make_cache(sdpa.config, peers[name], args.peer_residual) if name in peers
                         else _paged(model, args.page_size, name))
                caches[name] = _filled(empty, kv, batch)
                release_memory()
            kv_bytes = {name: (peer.kv_bytes(cache) if name in peers else cache.stats()["kv_bytes"])
                        for name, cache in caches.items()}
            bar.update(1)
            inputs = dict(input_ids=prompt[None].expand(batch, -1), attention_mask=torch.ones(batch, context,
                                                                                              dtype=torch.long),
                          do_sample=False, max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens,
                          pad_token_id=0)
            times = {name: [] for name in entries}
            for round_ in range(args.repeats):
                shift = round_ % len(entries)
                for name in entries[shift:] + entries[:shift]:
                    if name in peers:
                        runner, kwargs = sdpa, {hf_paged.CACHE_KWARG: peer.fork(caches[name])}
                    else:
                        runner, kwargs = model, {hf_paged.CACHE_KWARG: caches[name].fork()}
                    cpu, wall = time.process_time(), time.perf_counter()
                    runner.generate(**inputs, **kwargs)
                    times[name].append(((time.process_time() - cpu) / args.decode_tokens,
                                        (time.perf_counter() - wall) / args.decode_tokens))
                    del kwargs
                    release_memory()  # a fork's pages and tensors go now, not at some later round's collection
                bar.update(1)
            peak_rss = meter.before + meter.stop()  # bytes, the whole process (meter.method says how)
            for name in entries:
                q1, median, q3 = quartiles([c / f for (c, _), (f, _) in zip(times[name], times["float"])])
                results.append(dict(context=context, batch=batch, cache=name, peak_rss=peak_rss,
                                    cpu_ms=1e3 * statistics.median(c for c, _ in times[name]),
                                    wall_ms=1e3 * statistics.median(w for _, w in times[name]),
                                    cpu_ratio=median, cpu_ratio_q1=q1, cpu_ratio_q3=q3, kv_bytes=kv_bytes[name]))
            del caches
        del kv
    bar.close()
    return dict(page_size=args.page_size, decode_tokens=args.decode_tokens, repeats=args.repeats,
                threads=torch.get_num_threads(), peer_skipped=peer_skipped,
                memory_method="VmHWM, reset at the configuration's start" if meter.hwm else meter.method,
                results=results)


# ------------------------------------------------------------------------------------ mixed precision
def _fork_reading(cache, backend: str):
    """A fork of ``cache`` whose layers read their pages through ``backend`` ("torch": the gathers)."""
    fork = cache.fork()
    for layer in fork.layers:  # (a layer resolves its backend on its first read)
        layer.backend = backend
    return fork


def _streamed(cache, model, ids: torch.Tensor, chunk: int):
    """``cache`` after a forward of ``ids [B, T]`` in chunks of ``chunk`` tokens (a bounded cache demotes and
    evicts as they come, by the attention they get)."""
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            model.base_model(input_ids=ids[:, start:start + chunk], **{CACHE_KWARG: cache})
    return cache


def mixed_part(args, progress) -> dict:
    """``generate``'s decode speed at each ``--decode-contexts`` length and ``--decode-batches`` size of a
    mixed-precision cache (``cold_format="int4"``, read in place by the C kernel, and through the torch path's gathers)
    against float32 pages holding the whole prompt and the plain bounded cache of the same bytes (``--mixed-budget``
    of the batch's float32 bytes), all in pages of one token, entries alternating."""
    import hf_paged

    model, tokenizer, bar = _decode_setup(args, progress, "decode, mixed precision")
    results = []
    for context in args.decode_contexts:
        prompt = load_token_ids(tokenizer, context)[0]
        kv = _prefilled_kv(model, prompt[:-1])
        for batch in args.decode_batches:
            budget = max(8, round(batch * context * args.mixed_budget))  # float pages of one token, per layer group
            ids = prompt[None].expand(batch, -1)
            full = _filled(hf_paged.PagedCache(page_size=1, config=model.config), kv, batch)
            release_memory()

            def bounded(cold):  # a full bounded cache evicts in steady state: no fork (its parent would pin the pages)
                cache = hf_paged.PagedCache(page_size=1, max_pages=budget, config=model.config, cold_format=cold)
                return _streamed(cache, model, ids[:, :-1], max(1, min(256, budget // (4 * batch))))

            held = {}
            bar.update(1)
            inputs = dict(input_ids=ids, attention_mask=torch.ones(batch, context, dtype=torch.long), do_sample=False,
                          max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens, pad_token_id=0)
            times = {name: [] for name in MIXED_ENTRIES}
            for round_ in range(args.repeats):
                shift = round_ % len(MIXED_ENTRIES)
                mixed = bounded("int4")  # read by forks: its demotions make room for both
                made = dict(float=full.fork, mixed=mixed.fork)
                made.update({"bounded float": lambda: bounded(None), "mixed int4": mixed.fork,
                             "mixed int4, torch path": lambda: _fork_reading(mixed, "torch")})
                for name in MIXED_ENTRIES[shift:] + MIXED_ENTRIES[:shift]:
                    cache = made[name]()
                    release_memory()
                    held.setdefault(name, {k: cache.stats().get(k, 0) for k in ("kv_bytes", "tokens_held",
                                                                                   "pages_cold")})
                    cpu, wall = time.process_time(), time.perf_counter()
                    model.generate(**inputs, **{CACHE_KWARG: cache})
                    times[name].append(((time.process_time() - cpu) / args.decode_tokens,
                                        (time.perf_counter() - wall) / args.decode_tokens))
                    del cache
                    release_memory()
                del mixed, made
                bar.update(1)
            for name in MIXED_ENTRIES:
                q1, median, q3 = quartiles([c / f for (c, _), (f, _) in zip(times[name], times["float"])])
                results.append(dict(context=context, batch=batch, cache=name, budget=budget, **held[name],
                                    cpu_ms=1e3 * statistics.median(c for c, _ in times[name]),
                                    wall_ms=1e3 * statistics.median(w for _, w in times[name]),
                                    cpu_ratio=median, cpu_ratio_q1=q1, cpu_ratio_q3=q3))
            del full
        del kv
    bar.close()
    return dict(decode_tokens=args.decode_tokens, repeats=args.repeats, threads=torch.get_num_threads(),
                mixed_budget=args.mixed_budget, results=results)


def mixed_markdown(r: dict, environment: dict) -> list[str]:
    """The `mixed_part` table."""
    lines = ["## Mixed precision: `generate` decode speed of a cache with cold int4 pages, pages of one token", "",
             "float: float32 pages holding the whole prompt; bounded float: `PagedCache(max_pages=B)` (score "
             "eviction); mixed int4: `PagedCache(max_pages=B, cold_format=\"int4\")`, its hot float32 and cold int4 "
             "pages read in place by the C kernel; its torch path: the same pages gathered (dequantized copies) each "
             f"step. B: the float32 bytes of {r['mixed_budget']:g} of the batch's tokens per layer; the bounded caches "
             "take the prompt in chunks (demoting and evicting by attention as it comes); each round decodes "
             f"{r['decode_tokens']} new tokens from a fork of each, entries alternating, {r['repeats']} rounds, "
             f"{r['threads']} thread(s). "
             "Ratio: CPU time per new token against float32 pages in the same round, median [quartiles]. "
             f"Load average {environment['load_avg_start']} before, {environment.get('load_avg_end')} after.", ""]
    lines += _table("| context | batch | cache< | B | tokens held | cold pages (all layers) | CPU ms/token | "
                    "wall ms/token | vs float32 pages (CPU) | KV MiB |",
                    [[row["context"], row["batch"], row["cache"], "" if row["cache"] == "float" else row["budget"],
                      row["tokens_held"], row["pages_cold"], f"{row['cpu_ms']:.1f}", f"{row['wall_ms']:.1f}",
                      "—" if row["cache"] == "float" else _quartiles(row), f"{row['kv_bytes'] / 2**20:.1f}"]
                     for row in r["results"]])
    return lines + [""]


# ------------------------------------------------------------------------------------------- output
def _interval(row: dict) -> str:
    return f"{100 * row['relative']:+.2f}% [{100 * row['low']:+.2f}, {100 * row['high']:+.2f}]"


def _quartiles(row: dict) -> str:
    return f"{row['cpu_ratio']:.2f}x [{row['cpu_ratio_q1']:.2f}, {row['cpu_ratio_q3']:.2f}]"


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = ["# Quantized pages: perplexity, bytes and decode speed", ""]
    if s["quick"]:
        lines += ["**Smoke test (`--quick`): to check that everything runs; these numbers are not results.**", ""]
    if "perplexity" in report:
        r = report["perplexity"]
        lines += [f"## Perplexity and bytes: {s['model']}, {r['text']['tokens']} tokens of {r['text']['source']}", "",
                  "One forward through a DynamicCache that keeps what each page scheme hands back. Perplexity "
                  f"relative to float32 with a 95% paired bootstrap interval over blocks of {s['block']} tokens; KL: "
                  "mean divergence of the next-token distribution from float32's (nats per token); bytes: KV bytes "
                  "per token of the whole model, scales included.", "",
                  "| pages | perplexity | vs float32 [95% interval] | KL mean | KL p99 | top-1 agreement | "
                  "bytes/token | vs float32 | note |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for row in r["rows"]:
            vs = "—" if row["name"] == "float32" else _interval(row)
            lines.append(f"| {row['name']} | {row['perplexity']:.4f} | {vs} | {row['kl_mean']:.5f} | "
                         f"{row['kl_p99']:.4f} | {row['top1_agreement']:.4f} | {row['bytes_per_token']:.0f} | "
                         f"{row['bytes_ratio']:.3f}x | {row['note']} |")
        lines.append("")
    if "speed" in report:
        r = report["speed"]
        lines += [f"## C kernel decode call, one SmolLM2 layer ({r['layer']['query_heads']} query heads, "
                  f"{r['layer']['kv_heads']} KV heads, head dim {r['layer']['head_dim']}), pages of {r['page_size']}, "
                  f"{r['threads']} thread(s)", "",
                  f"Medians over {r['repeats']} rounds of {r['calls']} calls per format, formats alternating. Ratio: "
                  "CPU time against float32 pages per round, median [quartiles]; below 1 is faster. Load average "
                  f"{report['environment']['load_avg_start']} before, {report['environment']['load_avg_end']} after.",
                  "", "| context | batch | pages | CPU ms/call | wall ms/call | vs float32 (CPU) | KV MiB |",
                  "|---:|---:|---|---:|---:|---:|---:|"]
        for row in r["results"]:
            ratio = _quartiles(row) if row["format"] != "float32" else "—"
            lines.append(f"| {row['context']} | {row['batch']} | {row['format']} | {row['cpu_ms']:.3f} | "
                         f"{row['wall_ms']:.3f} | {ratio} | {row['kv_bytes'] / 2**20:.1f} |")
        lines.append("")
    if "cache" in report:
        lines += cache_markdown(report["cache"])
    if "agreement" in report:
        lines += agreement_markdown(report["agreement"], report["environment"])
    if "decode" in report:
        lines += decode_markdown(report["decode"], report["environment"])
    if "mixed" in report:
        lines += mixed_markdown(report["mixed"], report["environment"])
    return "\n".join(lines)


def _table(header: str, cells: list[list]) -> list[str]:
    """A markdown table: ``header`` ("| a | b |" with "<" after a left-aligned column's name), then one row each."""
    names = [c.strip() for c in header.strip("|").split("|")]
    rule = "|".join("---" if n.endswith("<") else "---:" for n in names)
    return ["| " + " | ".join(n.rstrip("<") for n in names) + " |", f"|{rule}|"] + \
        ["| " + " | ".join(map(str, row)) + " |" for row in cells]


def cache_markdown(r: dict) -> list[str]:
    """The `cache_part` tables."""
    sizes = r["bytes_per_token"]
    lines = [f"## Through the real caches: PagedCache with kv_format, pages of {r['page_size']}", "",
             f"KV bytes per token after a prefill of {r['bytes_tokens']} tokens, every layer, scales included "
             "(pages: `stats()[\"kv_bytes\"]`; QuantizedCache: its quantized history, the residual empty, and in "
             "brackets with its float residual full):", ""]
    full = {name: f" [{value['full_residual']:.0f}]" for name, value in r.get("peer_bytes", {}).items()}
    full_ratio = {name: f" [{value['full_residual'] / sizes['float32']:.3f}x]"
                  for name, value in r.get("peer_bytes", {}).items()}
    lines += _table("| cache< | bytes/token | vs float32 |",
                    [[name, f"{value:.0f}{full.get(name, '')}",
                      f"{value / sizes['float32']:.3f}x{full_ratio.get(name, '')}"]
                     for name, value in sizes.items()])
    if r.get("peer_skipped"):
        lines += ["", f"QuantizedCache rows skipped: {r['peer_skipped']}"]
    for block in r["perplexity"]:
        lines += ["", f"Perplexity, {block['tokens']} tokens of {r['text']['source']}, against float32 pages with a "
                  "95% paired bootstrap interval over blocks of tokens. Pages: one forward through "
                  "`PagedCache(kv_format=...)` ('hf_paged' attention); bfloat16: keys and values rounded to bfloat16 "
                  "(a DynamicCache keeping them so, 'sdpa'); QuantizedCache: the text in chunks of its residual "
                  "length, each token's decoding view ('sdpa'); int4 cold pages: `PagedCache(cold_format=\"int4\")` "
                  "(no budget: full pages demoted but the sinks), the text in chunks of a page, each token's "
                  "decoding view; its bytes: at the end of the text.", ""]
        lines += _table("| cache< | perplexity | vs float32 pages [95% interval] | KL mean | top-1 agreement | "
                        "bytes vs float32 |",
                        [[row["name"], f"{row['perplexity']:.4f}",
                          "—" if row["name"] == "float32" else _interval(row),
                          f"{row['kl_mean']:.5f}", f"{row['top1_agreement']:.4f}",
                          f"{row['bytes_per_token'] / sizes['float32']:.3f}x" if row["bytes_per_token"] else ""]
                         for row in block["rows"]])
        lines += [f"\n{row['name']} against {row['vs_peer']['name']}, paired: {_interval(row['vs_peer'])}"
                  for row in block["rows"] if "vs_peer" in row]
    return lines + [""]


def agreement_markdown(r: dict, environment: dict) -> list[str]:
    """The `agreement_part` table."""
    rows = r["rows"]
    lines = ["## Greedy agreement with float pages: `generate_many` over the many-prompts workload", "",
             f"{rows[0]['prompts']} Britannica prompts of 32-256 tokens, 8 or 64 new tokens each, pages of "
             f"{r['page_size']}, {r['threads']} thread(s). Per prompt: new tokens before the first difference from "
             "float32 pages' (median, min, prompts equal throughout); peak KV bytes of the run (`stats()` after a "
             f"step); CPU seconds per run, median of {r['repeats']} rounds (entries alternating) and the median "
             f"per-round ratio to float32 pages. Load average {environment['load_avg_start']} before, "
             f"{environment['load_avg_end']} after.", ""]
    lines += _table("| cache< | prompts equal | median | min | share of wanted | peak KV MiB | vs float32 | "
                    "CPU s/run | vs float32 (CPU) | per prompt< |",
                    [[row["cache"], f"{row['equal']}/{row['prompts']}", f"{row['median']:g}", row["min"],
                      f"{row['agreeing_share']:.1%}", f"{row['peak_kv_bytes'] / 2**20:.2f}",
                      f"{row['peak_kv_bytes'] / rows[0]['peak_kv_bytes']:.3f}x", f"{row['cpu_s']:.1f}",
                      f"{row['cpu_ratio']:.2f}",
                      ", ".join(f"{s}/{w}" for s, w in zip(row["tokens_before_divergence"], row["wanted"]))]
                     for row in rows])
    return lines + [""]


def decode_markdown(r: dict, environment: dict) -> list[str]:
    """The `decode_part` table."""
    lines = [f"## `generate` decode speed through the caches, pages of {r['page_size']}", "",
             f"Every cache holds the same keys and values (the prompt's, computed once in float32; in a batch, row r "
             f"offset by r/1000 so rows differ); each round decodes {r['decode_tokens']} new tokens from a fork "
             f"(pages) or a copy sharing its tensors (QuantizedCache) of each, entries alternating, {r['repeats']} "
             f"rounds, {r['threads']} thread(s). Ratio: CPU time per new token against float32 pages in the same "
             "round, median [quartiles]. "
             f"Load average {environment['load_avg_start']} before, {environment.get('load_avg_end')} after.", ""]
    if r.get("peer_skipped"):
        lines += [f"QuantizedCache rows skipped: {r['peer_skipped']}", ""]
    lines += _table("| context | batch | cache< | CPU ms/token | wall ms/token | vs float32 pages (CPU) | KV MiB |",
                    [[row["context"], row["batch"], row["cache"], f"{row['cpu_ms']:.1f}", f"{row['wall_ms']:.1f}",
                      "—" if row["cache"] == "float" else _quartiles(row), f"{row['kv_bytes'] / 2**20:.1f}"]
                     for row in r["results"]])
    peaks = {(row["context"], row["batch"]): row["peak_rss"] for row in r["results"] if "peak_rss" in row}
    if peaks:
        lines += ["", "Peak resident memory of the process per configuration (both models, the prompt's keys and "
                  "values, every cache and its forks; " + r.get("memory_method", "") + "): "
                  + ", ".join(f"{c} tokens x {b}: {v / 2**30:.2f} GiB" for (c, b), v in peaks.items()) + "."]
    return lines + [""]


def _ratio_axes(ax, ylabel: str, title: str) -> None:
    """Decode-time ratios against float32 pages over the context, on a log2 axis."""
    ax.axhline(1, color="black", lw=1, label="float32 pages")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    parts = [part for part in PARTS if part in report]
    fig, axes = plt.subplots(1, len(parts), figsize=(7 * len(parts), 5), squeeze=False)
    title = "SMOKE TEST, not a result: " if report["settings"]["quick"] else ""
    for ax, part in zip(axes[0], parts):
        if part == "perplexity":
            rows = report["perplexity"]["rows"][1:]
            for i, row in enumerate(rows):
                y = 100 * row["relative"]
                ax.errorbar(row["bytes_ratio"], y, yerr=[[y - 100 * row["low"]], [100 * row["high"] - y]], fmt="o",
                            capsize=3, color=f"C{i}", label=f"{row['name']} (KL {row['kl_mean']:.4f})")
            ax.axhline(0, color="black", lw=1)
            for target, (x, y) in TARGETS.items():  # each format's target: at most x of the bytes, y% perplexity
                ax.plot([0, x, x], [y, y, -1], ":", color="gray", lw=1)
                ax.annotate(f"{target} target", (x, y), fontsize=7, color="gray", xytext=(3, 3),
                            textcoords="offset points")
            ax.set_ylim(bottom=min(-0.5, *(100 * r["low"] for r in rows)))
            ax.set_xlabel("KV bytes per token / float32's")
            ax.set_ylabel("perplexity vs float32 pages (%), 95% interval")
            ax.set_title(f"{title}Perplexity against bytes, {report['perplexity']['text']['tokens']} tokens")
            ax.legend(fontsize=7)
        elif part == "cache":
            for style, block in zip(("o", "s", "^"), report["cache"]["perplexity"]):
                for i, row in enumerate(block["rows"][1:]):
                    y, x = 100 * row["relative"], row["bytes_per_token"] / block["rows"][0]["bytes_per_token"]
                    ax.errorbar(x, y, yerr=[[y - 100 * row["low"]], [100 * row["high"] - y]], fmt=style, capsize=3,
                                color=f"C{i}", label=f"{row['name']}, {block['tokens']} tokens")
            ax.axhline(0, color="black", lw=1)
            ax.set_yscale("symlog", linthresh=1)
            ax.set_xlabel("KV bytes per token / float32 pages'")
            ax.set_ylabel("perplexity vs float32 pages (%), 95% interval")
            ax.set_title(f"{title}Perplexity against bytes through the real caches")
            ax.legend(fontsize=6)
        elif part == "agreement":
            rows = report["agreement"]["rows"]
            for i, row in enumerate(rows):
                ax.plot(row["peak_kv_bytes"] / rows[0]["peak_kv_bytes"], 100 * row["agreeing_share"], "o",
                        color=f"C{i}", label=f"{row['cache']}: {row['equal']}/{row['prompts']} prompts equal")
            ax.set_xlabel("peak KV bytes / float32 pages'")
            ax.set_ylabel("wanted tokens before the first difference (%)")
            ax.set_title(f"{title}generate_many greedy agreement with float32 pages")
            ax.legend(fontsize=7)
        elif part in ("decode", "mixed"):
            results = report[part]["results"]
            names = list(dict.fromkeys(r["cache"] for r in results))
            for i, name in enumerate(names[1:], start=1):
                for batch, style in zip(sorted({r["batch"] for r in results}), ("-o", "--s", ":^")):
                    pts = [(r["context"], r["cpu_ratio"]) for r in results
                           if r["cache"] == name and r["batch"] == batch]
                    ax.plot(*zip(*pts), style, color=f"C{i}", label=f"{name}, batch {batch}")
            ax.set_yscale("log", base=2)
            _ratio_axes(ax, "CPU time per new token / float32 pages'",
                        f"{title}generate decode" + (", mixed precision" if part == "mixed" else " through the caches"))
        else:
            results = report["speed"]["results"]
            batches = sorted({r["batch"] for r in results})
            for i, name in enumerate(SPEED_FORMATS[1:], start=1):
                for batch, style in zip(batches, ("-o", "--s", ":^", "-.v")):
                    pts = [(r["context"], r["cpu_ratio"]) for r in results
                           if r["format"] == name and r["batch"] == batch]
                    ax.plot(*zip(*pts), style, color=f"C{i}", label=f"{name}, batch {batch}")
            _ratio_axes(ax, "CPU time per decode call / float32 pages'", f"{title}C kernel decode, one SmolLM2 layer")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    """Run the parts of ``args`` (scripts/quantized.py's arguments); print the report and write it to ``args.out``."""
    torch.set_num_threads(args.threads)
    from tqdm.auto import tqdm

    def progress(**kw):
        return tqdm(disable=args.no_progress, dynamic_ncols=True, **kw)

    packages = ("torch", "transformers", "hf_paged", "optimum-quanto")
    environment = dict(load_avg_start=load_average(), **versions(packages),
                       cpu=platform.processor() or platform.machine(), threads=args.threads)
    report = dict(settings={k: v for k, v in vars(args).items() if k != "no_progress"}, environment=environment)
    t0 = time.perf_counter()
    for part in args.parts:
        report[part] = {"perplexity": perplexity_part, "speed": speed_part, "cache": cache_part,
                        "agreement": agreement_part, "decode": decode_part, "mixed": mixed_part}[part](args, progress)
    environment.update(load_avg_end=load_average(), wall_s=time.perf_counter() - t0)
    table = markdown(report)
    write_report(Path(args.out), "quantized", table, report, plot=lambda path: plot(report, path))
    print(table)
    print(f"wrote quantized.md, quantized.json and quantized.png in {args.out}")
    return 0
