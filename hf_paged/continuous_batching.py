"""`generate_many` / `stream_many`: continuous batching over many prompts on a paged cache.

Rows of different lengths share one page pool and advance independently: every step packs one
token per decoding row and prefill chunks of new rows into a single forward (at most
``max_batch_tokens`` tokens), a row that finishes (a stop token or its own ``max_new_tokens``)
gives its pages back at once, and waiting prompts start in them. Shared prefixes (a system
prompt, the samples of one prompt) are computed once. Greedy output equals per-prompt
``model.generate`` token for token.
"""

from __future__ import annotations

import collections
import contextlib
import math
import numbers
import operator
import time
import weakref
from collections.abc import Iterator, Sequence

import numpy as np

import torch
from tqdm.auto import tqdm
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .cpu_weights import packed_linear_weights
from .model_config import ATTN_IMPLEMENTATION, CACHE_KWARG
from .errors import CacheUsageError
from .prefix_index import model_fingerprint
from .ragged_cache import RaggedCache
from .scheduler import Request, Row, Scheduler


def _as_int(name: str, value) -> int:
    """``value`` as an int when it is one (a Python or NumPy integer, an integer tensor of one element)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise CacheUsageError(f"{name} must be an int, got {value!r} ({type(value).__name__}).") from None


def _as_token_lists(prompts, tokenizer) -> list[list[int]]:
    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise CacheUsageError("prompts must be a list of token-id lists (or of strings, with tokenizer=).")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise CacheUsageError(f"prompt {i} is a string: pass tokenizer= to tokenize it.")
            prompt = tokenizer(prompt)["input_ids"]
        if isinstance(prompt, torch.Tensor):
            if prompt.is_floating_point() or prompt.is_complex():
                raise CacheUsageError(f"prompt {i} is a {prompt.dtype} tensor: token ids are ints (use .long()).")
            prompt = prompt.reshape(-1).tolist()
        out.append([_as_int(f"prompt {i}'s token ids", t) for t in prompt])
    return out


def _int_or_ints(name: str, value) -> int | list[int]:
    """An int (Python, NumPy, an integer tensor of one element), or a list of them, from ``value``; never a
    truncated float."""
    try:
        return _as_int(name, value)
    except CacheUsageError:
        if not isinstance(value, (Sequence, torch.Tensor, np.ndarray)) or isinstance(value, str) or (
                getattr(value, "ndim", 1) == 0):
            raise CacheUsageError(f"{name} must be an int or a list of ints, got {value!r} "
                                  f"({type(value).__name__}).") from None
        return [_as_int(f"each of {name}", v) for v in value]


def _per_prompt(name: str, value, count: int) -> list[int]:
    """One int for every prompt, or one each."""
    values = _int_or_ints(name, value)
    values = [values] * count if isinstance(values, int) else values
    if len(values) != count:
        raise CacheUsageError(f"{name} has {len(values)} entries for {count} prompts: give one int or one per prompt.")
    return values


def _check_sampling(do_sample, temperature, top_k, top_p, num_return_sequences) -> None:
    """Sampling arguments of the types and ranges the warpers take (else a clear error, before any work)."""
    if not isinstance(do_sample, bool):
        raise CacheUsageError(f"do_sample must be True or False, got {do_sample!r}.")
    if _as_int("num_return_sequences", num_return_sequences) < 1:
        raise CacheUsageError(f"num_return_sequences must be a positive int, got {num_return_sequences!r}.")
    if not do_sample:
        return
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 < temperature < math.inf:
        raise CacheUsageError(f"temperature must be a positive number, got {temperature!r}.")
    if top_k is not None and _as_int("top_k", top_k) < 0:
        raise CacheUsageError(f"top_k must be None, 0 (off) or a positive int, got {top_k!r}.")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise CacheUsageError(f"top_p must be None or a number in (0, 1], got {top_p!r}.")


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


def stream_many(model, prompts, *, max_new_tokens: int | Sequence[int], tokenizer=None, do_sample: bool = False,
                temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                seed: int | Sequence[int] = 0, num_return_sequences: int = 1, eos_token_id: int | Sequence[int] | None = None,
                page_size: int = 16, max_pages: int | None = None, max_batch_tokens: int = 256,
                cache: RaggedCache | None = None, progress: bool = True,
                prefix_store=None, pack_weights: bool = False) -> Iterator[tuple[int, int]]:
    """Yield ``(output index, token)`` as tokens are produced; output ``i * num_return_sequences + j`` is
    sample ``j`` of prompt ``i``. Arguments as for `generate_many`; they are checked here, before the generator
    is returned. The cache is taken (for this thread) when iteration starts and given back, every row released,
    when the generator ends or is closed: a loop that stops early should ``close()`` it (or drop it) before the
    cache serves another run."""
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        raise CacheUsageError("generate_many needs the model loaded with attn_implementation='hf_paged'.")
    if getattr(model.config, "is_encoder_decoder", False):
        raise CacheUsageError("generate_many supports decoder-only models.")
    token_lists = _as_token_lists(prompts, tokenizer)
    max_new = _per_prompt("max_new_tokens", max_new_tokens, len(token_lists))
    if _as_int("max_batch_tokens", max_batch_tokens) < 1:
        raise CacheUsageError(f"max_batch_tokens must be a positive int, got {max_batch_tokens!r}.")
    _check_sampling(do_sample, temperature, top_k, top_p, num_return_sequences)
    num_return_sequences = int(num_return_sequences)
    seeds = _int_or_ints("seed", seed)
    seeds = (_per_prompt("seed", seeds, len(token_lists)) if isinstance(seeds, list) else
             [seeds + i * num_return_sequences for i in range(len(token_lists))])
    if cache is not None and not isinstance(cache, RaggedCache):
        raise CacheUsageError(f"cache must be a RaggedCache (or None: generate_many makes one), got "
                              f"{type(cache).__name__}.")
    if cache is not None and prefix_store is not None:
        raise CacheUsageError("pass prefix_store= to the RaggedCache given as cache= (RaggedCache(config, ..., "
                              "prefix_store=...)), or leave cache= out.")
    own_store = cache is None and prefix_store is not None  # (closed when the run ends)
    cache = cache or RaggedCache(model.config, page_size, max_pages, prefix_store=prefix_store)
    _check(token_lists, max_new, model.config.get_text_config(decoder=True).vocab_size, cache)
    if eos_token_id is None:
        eos_token_id = model.generation_config.eos_token_id
    stop = _int_or_ints("eos_token_id", [] if eos_token_id is None else eos_token_id)
    stop = {stop} if isinstance(stop, int) else set(stop)
    warp = LogitsProcessorList()
    if do_sample:
        if temperature != 1.0:
            warp.append(TemperatureLogitsWarper(temperature))
        if top_k:
            warp.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1.0:
            warp.append(TopPLogitsWarper(top_p))
    requests = [Request(i, p, n, num_return_sequences) for i, (p, n) in enumerate(zip(token_lists, max_new))]
    root = model_fingerprint(model, cache.page_size, [layer.sliding_window for layer in cache.layers])
    scheduler = Scheduler(cache, requests, int(max_batch_tokens), root)
    if cache.store_tier is not None:
        cache.store_tier.bind(root, model)
    generators = {}
    if do_sample:
        for i, first in enumerate(seeds):
            for j in range(num_return_sequences):
                generators[i * num_return_sequences + j] = torch.Generator().manual_seed(first + j)
    run = _Run()
    stream = _stream(run, model, cache, scheduler, warp, generators, stop, len(requests) * num_return_sequences,
                     progress, pack_weights, own_store)
    run.generator = weakref.ref(stream)
    return stream


class _Run:
    """One `stream_many` run as its cache sees it (`RaggedCache.claim`): live until its generator has ended."""

    generator = None  # a weak reference to the run's generator

    @property
    def live(self) -> bool:
        stream = self.generator() if self.generator is not None else None
        return stream is not None and stream.gi_frame is not None


def _stream(run: _Run, model, cache: RaggedCache, scheduler: Scheduler, warp, generators, stop: set[int],
            outputs: int, progress: bool, pack_weights: bool, own_store: bool = False) -> Iterator[tuple[int, int]]:
    """The steps of a run; the cache is taken when iteration starts and given back (every row it still holds
    released) when the generator ends, raises or is closed; weights packed for the run are unpacked then too. With a
    prefix store, prefill steps are timed (the rate loads are weighed against), its counters end on the bar, and a
    store opened for this run is closed."""
    cache.claim(run)
    device = model.device
    packing = contextlib.ExitStack()  # weights packed for this call are unpacked when it ends
    bar = tqdm(total=outputs, unit="seq", disable=not progress, desc="generate_many")
    try:
        if pack_weights:
            packing.enter_context(packed_linear_weights(model))
        while not scheduler.done:
            step = scheduler.schedule()
            if not step:
                raise CacheUsageError("generate_many cannot admit the next prompt: the page pool is too small.")
            tokens = [t for row, n in step for t in row.tokens[row.computed:row.computed + n]]
            positions = [p for row, n in step for p in range(row.computed, row.computed + n)]
            emitting, last, start = [], [], 0
            for row, n in step:
                start += n
                if row.computed + n == len(row.tokens):
                    emitting.append(row)
                    last.append(start - 1)
            scheduler.plan(step)
            prefill = sum(n for _, n in step if n > 1)
            started = time.perf_counter()
            try:
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([tokens], device=device),
                                   position_ids=torch.tensor([positions], device=device),
                                   logits_to_keep=torch.tensor(last, dtype=torch.long, device=device), use_cache=True,
                                   **{CACHE_KWARG: cache}).logits[0]
            except BaseException:
                cache.abort_step()
                raise
            if cache.store_tier is not None and prefill >= cache.page_size:
                cache.store_tier.record_prefill(prefill, time.perf_counter() - started)
            scheduler.after_step(step)
            # greedy: the argmax on the logits' device; sampling: the logits come to the CPU, where every draw uses
            # its output's own CPU generator (the same draws on any device, whatever else the step computed)
            logits = logits.float().cpu() if generators else logits.argmax(-1).tolist()
            for row, row_logits in zip(emitting, logits):
                for sample in [row, *scheduler.fork_followers(row)]:
                    token = _next_token(row_logits, warp, generators.get(sample.out_index), sample)
                    sample.generated.append(token)
                    sample.tokens.append(token)
                    yield sample.out_index, token
                    if not cache.holds(run):
                        raise CacheUsageError(
                            "the RaggedCache of this stream_many generator was reset (or taken by another "
                            "generate_many run) while the generator was paused: its rows are gone. Start a new "
                            "stream_many.")
                    if token in stop or len(sample.generated) >= sample.request.max_new_tokens:
                        scheduler.retire(sample)
                        bar.update()
    finally:
        if cache.store_tier is not None:
            counts = cache.store_tier.counters_snapshot()
            bar.set_postfix({k.removeprefix("store_"): counts[k] for k in ("store_hits", "store_pages_written")})
            if own_store:
                cache.store_tier.close()
        bar.close()
        packing.close()
        cache.unclaim(run)


def _next_token(logits: torch.Tensor | int, warp: LogitsProcessorList, generator, row: Row) -> int:
    """``row``'s next token: ``logits`` is the greedy token already (no ``generator``), else the row's float32 CPU
    logits, warped, from which ``generator`` (a CPU generator) draws."""
    if generator is None:
        return int(logits)
    scores = warp(torch.tensor([row.tokens]), logits[None])[0]
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


def generate_many(model, prompts, *, max_new_tokens: int | Sequence[int], tokenizer=None, do_sample: bool = False,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  seed: int | Sequence[int] = 0, num_return_sequences: int = 1, eos_token_id: int | Sequence[int] | None = None,
                  page_size: int = 16, max_pages: int | None = None, max_batch_tokens: int = 256,
                  cache: RaggedCache | None = None, progress: bool = True, prefix_store=None,
                  pack_weights: bool = False) -> list[list[int]]:
    """Generate for many prompts with continuous batching; the new tokens of every output, in input order.

    Args:
        prompts: token-id lists (or strings, with ``tokenizer=``), of any lengths; no padding.
        max_new_tokens: one int, or one per prompt.
        do_sample, temperature, top_k, top_p: sampling (greedy by default); every output samples with its
            own generator, so results do not depend on batching: sample ``j`` of prompt ``i`` is seeded
            ``seed + i * num_return_sequences + j``, or ``seed[i] + j`` when ``seed`` has one int per prompt.
        num_return_sequences: samples per prompt (they share the prompt's pages).
        eos_token_id: stop token(s); default the model's generation config.
        page_size, max_pages: the page pool (``max_pages=None`` grows); prompts wait for pages when full.
        max_batch_tokens: tokens per step (decode tokens + prefill chunks), which bounds each step.
        cache: a `RaggedCache` to reuse across calls (its cached prefix pages are then shared).
        progress: show a tqdm bar of finished sequences (with a prefix store: its page hits and writes).
        prefix_store: a prefix store for a cache made here (a URI, a folder path or a store from
            `hf_paged.open_store`): prompts' pages are written to it and loaded from it instead of computed when
            that is estimated faster; a store opened from a URI is flushed and closed when the run ends. With
            ``cache=``, give the store to the `RaggedCache` instead.
        pack_weights: pack the model's float32 CPU linear weights for this call (`hf_paged.cpu_weights`; the
            packing is undone at the end). To pack once for many calls, use `pack_linear_weights` instead.
    """
    outputs = collections.defaultdict(list)
    for index, token in stream_many(
            model, prompts, max_new_tokens=max_new_tokens, tokenizer=tokenizer, do_sample=do_sample,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, num_return_sequences=num_return_sequences,
            eos_token_id=eos_token_id, page_size=page_size, max_pages=max_pages, max_batch_tokens=max_batch_tokens,
            cache=cache, progress=progress, prefix_store=prefix_store, pack_weights=pack_weights):
        outputs[index].append(token)
    return [outputs[i] for i in range(len(prompts) * num_return_sequences)]  # (validated by stream_many)
