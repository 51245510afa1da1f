"""`generate_many` / `stream_many`: continuous batching over many prompts on a paged cache.

Sequences of different lengths share one page pool and advance independently: every step packs one
token per decoding sequence and prefill chunks of new sequences into a single forward (at most
``max_batch_tokens`` tokens), a sequence that finishes (a stop token or its own ``max_new_tokens``)
gives its pages back at once, and waiting prompts start in them. Shared prefixes (a system
prompt, the samples of one prompt) are computed once. Greedy output equals per-prompt
``model.generate`` token for token.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator, Sequence

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, LogitsProcessorList

from .compiled_many import active_cache, compile_many_steps
from .cpu_weights import is_packed, packed_linear_weights
from .demotion import pages_format
from .model_config import ATTN_IMPLEMENTATION, CACHE_KWARG
from .errors import CacheUsageError
from .kv_formats import check_kv_format
from .generation_options import GenerationOptions, ManyOutput, as_int, int_or_ints, per_prompt, token_lists
from .stats import GenerationStats
from .prefix_index import model_fingerprint
from .ragged_cache import RaggedCache
from .scheduler import Request, Scheduler


def _check(prompts: list[list[int]], max_new: list[int], vocab_size: int, cache: RaggedCache) -> None:
    """Refuse bad requests before any work starts, naming the prompt."""
    limit = cache.manager.max_pages
    for i, (prompt, new) in enumerate(zip(prompts, max_new)):
        if not prompt:
            raise CacheUsageError(f"prompt {i} is empty: every prompt needs at least one token.")
        if new < 1:
            raise CacheUsageError(f"prompt {i}: max_new_tokens must be a positive int, got {new!r}.")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise CacheUsageError(f"prompt {i} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}.")
        pages = -(-(len(prompt) + new) // cache.page_size)
        if limit is not None and pages > limit:
            raise CacheUsageError(
                f"prompt {i} needs {pages} pages ({len(prompt)} prompt + {new} new tokens) but max_pages={limit}: "
                "raise max_pages or lower its max_new_tokens.")


def _cache_for(model, cache: RaggedCache | None, page_size: int | None, max_pages: int | None,
               kv_format: str | None, prefix_store=None, cold_format: str | None = None) -> RaggedCache:
    """The run's cache: ``cache``, or a new one of ``page_size`` (default 16) and ``max_pages`` pages in ``kv_format``
    (default "float"), which the model's device must read (and ``prefix_store``, ``cold_format``). The pool's
    arguments belong to the cache: with ``cache=``, values other than the cache's own are refused."""
    if cache is None:
        cache = RaggedCache(model.config, 16 if page_size is None else page_size, max_pages,
                            kv_format="float" if kv_format is None else kv_format, prefix_store=prefix_store,
                            cold_format=cold_format)
        check_kv_format(cache.kv_format, model.device)
        return cache
    if prefix_store is not None:
        raise CacheUsageError("pass prefix_store= to the RaggedCache given as cache= (RaggedCache(config, ..., "
                              "prefix_store=...)), or leave cache= out.")
    if not isinstance(cache, RaggedCache):
        raise CacheUsageError(f"cache must be a RaggedCache (or None: generate_many makes one), got "
                              f"{type(cache).__name__}.")
    check_kv_format(cache.kv_format, model.device)
    for name, given, own in (("page_size", page_size, cache.page_size), ("max_pages", max_pages,
                                                                         cache.manager.max_pages),
                             ("kv_format", kv_format, cache.kv_format),
                             ("cold_format", cold_format, cache.cold_format)):
        if given is not None and given != own:
            raise CacheUsageError(f"{name}={given!r} with cache= (whose {name} is {own!r}): the pool's size is the "
                                  f"cache's. Give it to RaggedCache(...) or leave cache= out.")
    return cache


def stream_many(model, prompts, *, max_new_tokens: int | Sequence[int] | None = None,
                generation_config: GenerationConfig | None = None, tokenizer=None,
                logits_processor: LogitsProcessorList | None = None, seed: int | Sequence[int] = 0,
                do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                top_p: float | None = None, num_return_sequences: int | None = None,
                eos_token_id: int | Sequence[int] | None = None, repetition_penalty: float | None = None,
                min_new_tokens: int | None = None, stop_strings: str | Sequence[str] | None = None,
                bad_words_ids: Sequence[Sequence[int]] | None = None, attention_mask: torch.Tensor | None = None,
                page_size: int | None = None, max_pages: int | None = None, max_batch_tokens: int = 256,
                cache: RaggedCache | None = None, progress: bool = True, stats: GenerationStats | None = None,
                pack_weights: bool = False, compile: bool = False, kv_format: str | None = None,
                prefix_store=None, cold_format: str | None = None, **generate_kwargs) -> Iterator[tuple[int, int]]:
    """Yield ``(output index, token)`` as tokens are produced; output ``i * num_return_sequences + j`` is
    sample ``j`` of prompt ``i``. Arguments as for `generate_many`; they are checked here, before the generator
    is returned. The cache is taken (for this thread) when iteration starts and given back, every sequence released,
    when the generator ends or is closed: a loop that stops early should ``close()`` it (or drop it) before the
    cache serves another run. ``stats`` (a `GenerationStats`) is filled as the run goes, finish reasons included."""
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        raise CacheUsageError("generate_many needs the model loaded with attn_implementation='hf_paged'.")
    if getattr(model.config, "is_encoder_decoder", False):
        raise CacheUsageError("generate_many supports decoder-only models.")
    prompts = token_lists(prompts, tokenizer, attention_mask)
    options = GenerationOptions(model, generation_config, dict(
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
        num_return_sequences=num_return_sequences, eos_token_id=eos_token_id, repetition_penalty=repetition_penalty,
        min_new_tokens=min_new_tokens, stop_strings=stop_strings, bad_words_ids=bad_words_ids, **generate_kwargs),
        logits_processor, tokenizer)
    if max_new_tokens is None:
        max_new_tokens = options.config.max_new_tokens
        if max_new_tokens is None:
            raise CacheUsageError("give max_new_tokens (one int, or one per prompt), or set it in generation_config: "
                                  "generate_many does not take max_length (its prompts have different lengths).")
    max_new = per_prompt("max_new_tokens", max_new_tokens, len(prompts))
    if compile and (pack_weights or any(is_packed(m) for m in model.modules())):
        raise CacheUsageError("compile=True packs the linear weights itself (inductor's freezing): drop "
                              "pack_weights=True, or unpack the model first (hf_paged.unpack_linear_weights(model)).")
    if as_int("max_batch_tokens", max_batch_tokens) < 1:
        raise CacheUsageError(f"max_batch_tokens must be a positive int, got {max_batch_tokens!r}.")
    n = options.num_return_sequences
    seeds = int_or_ints("seed", seed)
    seeds = (per_prompt("seed", seeds, len(prompts)) if isinstance(seeds, list) else
             [seeds + i * n for i in range(len(prompts))])
    own_store = cache is None and prefix_store is not None  # (closed when the run ends)
    cache = _cache_for(model, cache, page_size, max_pages, kv_format, prefix_store, cold_format)
    if compile and cache.cold_format is not None:
        raise CacheUsageError(f"compile=True reads one pool of pages per layer; cold_format={cache.cold_format!r} "
                              "keeps two tiers. Drop compile=True, or use cold_format=None.")
    _check(prompts, max_new, model.config.get_text_config(decoder=True).vocab_size, cache)
    requests = [Request(i, p, m, n) for i, (p, m) in enumerate(zip(prompts, max_new))]
    root = model_fingerprint(model, cache.page_size, [layer.sliding_window for layer in cache.layers],
                             pages_format(cache.kv_format, cache.cold_format))
    scheduler = Scheduler(cache, requests, int(max_batch_tokens), root)
    if cache.store_tier is not None:
        cache.store_tier.bind(root, model)
    generators = {}
    if options.do_sample:
        for i, first in enumerate(seeds):
            for j in range(n):
                generators[i * n + j] = torch.Generator().manual_seed(first + j)
    lengths = [len(p) for p in prompts for _ in range(n)]
    run = _Run()
    stream = _stream(run, model, cache, scheduler, options, options.needs_scores(requests), generators,
                     GenerationStats() if stats is None else stats, lengths, progress, pack_weights, own_store,
                     compile_many_steps(model) if compile else None)
    run.generator = weakref.ref(stream)
    return stream


class _Run:
    """One `stream_many` run as its cache sees it (`RaggedCache.claim`): live until its generator has ended."""

    generator = None  # a weak reference to the run's generator

    @property
    def live(self) -> bool:
        stream = self.generator() if self.generator is not None else None
        return stream is not None and stream.gi_frame is not None


def _queued(scheduler: Scheduler) -> int:
    """Prompts waiting to start (a repeated prompt counts once per request)."""
    return sum(1 + len(request.duplicates) for request in scheduler.waiting)


def _stream(run: _Run, model, cache: RaggedCache, scheduler: Scheduler, options: GenerationOptions, scores: bool,
            generators, stats: GenerationStats, prompt_lengths: list[int], progress: bool,
            pack_weights: bool, own_store: bool = False, compiled=None) -> Iterator[tuple[int, int]]:
    """The steps of a run; the cache is taken when iteration starts and given back (every sequence it still holds
    released) when the generator ends, raises or is closed; weights packed for the run are unpacked then too.
    ``stats`` starts when iteration starts. With a prefix store, prefill steps are timed (the rate loads are weighed
    against), its counters end on the bar, and a store opened for this run is closed. ``compiled``: the model's
    compiled forward (`hf_paged.compiled_many`), run with the cache active."""
    cache.claim(run)
    stats.start(prompt_lengths)
    device = model.device
    forward = model if compiled is None else compiled
    packing = contextlib.ExitStack()  # weights packed for this call are unpacked when it ends
    bar = tqdm(total=len(stats.outputs), unit="seq", disable=not progress, desc="generate_many")
    try:
        if pack_weights:
            packing.enter_context(packed_linear_weights(model))
        while not scheduler.done:
            hits = cache.prefix_hits
            step = scheduler.schedule()
            if not step:
                raise CacheUsageError("generate_many cannot admit the next prompt: the page pool is too small.")
            stats.admitted(r.out_index for seq, _ in step for r in (seq, *seq.followers))
            tokens = [t for seq, n in step for t in seq.tokens[seq.computed:seq.computed + n]]
            positions = [p for seq, n in step for p in range(seq.computed, seq.computed + n)]
            emitting, last, start = [], [], 0
            for seq, n in step:
                start += n
                if seq.computed + n == len(seq.tokens):
                    emitting.append(seq)
                    last.append(start - 1)
            scheduler.plan(step)
            # a compiled forward keeps a row's logits even when no row emits (they are not read): with none, inductor
            # finds the output empty and drops the whole forward, the slot writes (an opaque op) with it
            keep = last if last or compiled is None else [len(tokens) - 1]
            prefill = sum(n for _, n in step if n > 1)
            began = time.perf_counter()
            try:
                with torch.no_grad(), active_cache(cache):
                    logits = forward(input_ids=torch.tensor([tokens], device=device),
                                     position_ids=torch.tensor([positions], device=device),
                                     logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
                                     use_cache=True, **{CACHE_KWARG: cache}).logits[0]
            except BaseException:
                cache.abort_step()
                raise
            seconds = time.perf_counter() - began
            if cache.store_tier is not None and prefill >= cache.page_size:
                cache.store_tier.record_prefill(prefill, seconds)
            scheduler.after_step(step)
            # raw argmax: on the logits' device; processed or sampled: the logits come to the CPU (float32), where
            # the processors read each output's own tokens and every draw uses its output's own CPU generator (the
            # same draws on any device, whatever else the step computed)
            logits = logits.float().cpu() if scores else logits.argmax(-1).tolist()
            finished = produced = 0
            for seq, seq_logits in zip(emitting, logits):
                for sample in [seq, *scheduler.fork_followers(seq)]:
                    request = sample.request
                    token = (options.next_token(seq_logits, sample.tokens, len(request.prompt), request.max_new_tokens,
                                                generators.get(sample.out_index)) if scores else int(seq_logits))
                    sample.generated.append(token)
                    sample.tokens.append(token)
                    stats.token(sample.out_index)
                    produced += 1
                    yield sample.out_index, token
                    if not cache.holds(run):
                        raise CacheUsageError(
                            "the RaggedCache of this stream_many generator was reset (or taken by another "
                            "generate_many run) while the generator was paused: its sequences are gone. Start a new "
                            "stream_many.")
                    reason = options.finish_reason(sample.tokens, len(sample.generated), request.max_new_tokens)
                    if reason is not None:
                        scheduler.retire(sample)
                        stats.finished(sample.out_index, reason)
                        finished += 1
            stats.step(prompt_tokens=sum(n for seq, n in step if seq.computed - n < len(seq.request.prompt)),
                       generated=produced,
                       prefix_hits=cache.prefix_hits - hits, seconds=seconds, queue_length=_queued(scheduler),
                       running=len(scheduler.running), cache_stats=cache.stats())
            bar.set_postfix(stats.postfix(), refresh=False)
            bar.update(finished)
    finally:
        stats.end()
        if cache.store_tier is not None:
            counts = cache.store_tier.counters_snapshot()
            bar.set_postfix({**stats.postfix(), "store hits": counts["store_hits"],
                             "store writes": counts["store_pages_written"]}, refresh=False)
            if own_store:
                cache.store_tier.close()
        bar.close()
        packing.close()
        cache.unclaim(run)


def generate_many(model, prompts, *, max_new_tokens: int | Sequence[int] | None = None,
                  generation_config: GenerationConfig | None = None, tokenizer=None, decode: bool = False,
                  return_dict_in_generate: bool = False, **kwargs) -> list[list[int]] | list[str] | ManyOutput:
    """Generate for many prompts with continuous batching; the new tokens of every output, in input order.

    Args:
        prompts: token-id lists (or strings, with ``tokenizer=``), of any lengths, no padding; or a 2-D tensor
            (``attention_mask=`` drops padding), or what ``tokenizer(..., return_tensors="pt")`` returns.
        max_new_tokens: one int, or one per prompt (default ``generation_config.max_new_tokens``).
        generation_config: a `GenerationConfig`; merged as `generate` merges it (``model.generation_config`` as
            defaults, keywords on top). Any of its fields is a keyword too: ``do_sample``, ``temperature``,
            ``top_k`` (50 when sampling, as in `generate`), ``top_p``, ``repetition_penalty``, ``min_new_tokens``,
            ``stop_strings`` (with ``tokenizer=``), ``bad_words_ids``, ``eos_token_id``, ``num_return_sequences``,
            ... Greedy search and sampling; processors are transformers' own, each reading its output's tokens.
        logits_processor: a `LogitsProcessorList` applied with the built-in ones (as in `generate`).
        seed: every output samples with its own generator, so results do not depend on batching: sample ``j`` of
            prompt ``i`` is seeded ``seed + i * num_return_sequences + j``, or ``seed[i] + j`` for a list.
        tokenizer: tokenizes string prompts; needed by ``stop_strings`` and ``decode``.
        decode: return strings (``tokenizer.decode(..., skip_special_tokens=True)``) instead of token ids.
        return_dict_in_generate: return a `ManyOutput` (sequences, finish reasons, stats, texts).
        page_size, max_pages, kv_format: the page pool of a new cache (16, ``None``: it grows, "float"; "int8",
            "int4", or "fp8_e4m3" on CUDA, as for `PagedCache`); prompts wait for pages when it is full.
        cold_format: "int4" or "int8" for a new cache (`RaggedCache`'s ``cold_format``): each sequence's full pages
            but its sinks re-quantized once filled, as `PagedCache(cold_format=...)` does (not with ``compile``).
        max_batch_tokens: tokens per step (decode tokens + prefill chunks), which bounds each step.
        cache: a `RaggedCache` to reuse across calls (its cached prefix pages are then shared).
        progress: a tqdm bar of finished sequences, with tokens/s, queue, pages and time to first token.
        stats: a `GenerationStats` to fill (also on ``ManyOutput.stats``).
        prefix_store: a prefix store for a cache made here (a URI, a folder path or a store from
            `hf_paged.open_store`): prompts' pages are written to it and loaded from it instead of computed when
            that is estimated faster; a store opened from a URI is flushed and closed when the run ends. With
            ``cache=``, give the store to the `RaggedCache` instead.
        pack_weights: pack the model's float32 CPU linear weights for this call (`hf_paged.cpu_weights`; the
            packing is undone at the end). To pack once for many calls, use `pack_linear_weights` instead.
        compile: run the steps through the model's forward compiled by `hf_paged.compile_many_steps` (inductor,
            weights frozen and packed, q/k/v and gate/up merged, elementwise work fused; compiled on the first call,
            kept on the model; weights changed later need ``compile_many_steps(model, recompile=True)``).
    """
    if decode and tokenizer is None:
        raise CacheUsageError("decode=True needs tokenizer=.")
    stats = kwargs.pop("stats", None) or GenerationStats()
    outputs: dict[int, list[int]] = {}
    for index, token in stream_many(model, prompts, max_new_tokens=max_new_tokens, generation_config=generation_config,
                                    tokenizer=tokenizer, stats=stats, **kwargs):
        outputs.setdefault(index, []).append(token)
    sequences = [outputs.get(i, []) for i in range(len(stats.outputs))]
    texts = [tokenizer.decode(s, skip_special_tokens=True) for s in sequences] if decode else None
    if return_dict_in_generate:
        return ManyOutput(sequences, [o.finish_reason for o in stats.outputs], stats, texts)
    return texts if decode else sequences
