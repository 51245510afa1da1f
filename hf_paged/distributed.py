"""Data-parallel generation over a prompt set with accelerate: one model and one page pool per process.

Launch a script that calls :func:`generate_distributed` with ``accelerate launch`` (or ``torchrun``):
every process loads the model on its own device (``state.device``), generates its share of the
prompts and all processes exchange the results with ``accelerate.utils.gather_object``, so every
rank returns every prompt's completion, in input order.

How the work is split, and why a run on N processes gives the same output as a run on one:

1. every prompt is tokenized once and the prompts are sorted by length (longest first);
2. the prompts are dealt to the processes in snake order (see :func:`deal`), through
   ``PartialState.split_between_processes`` (without ``apply_padding``, which would repeat the last
   item on the short ranks), so every process gets a share of similar total length, and every
   process gets prompts whenever there are at least as many prompts as processes;
3. each process runs continuous batching (:func:`hf_paged.generate_many`) over its share: rows of
   different lengths share one page pool, finished rows free their pages at once, and no prompt is
   padded, so a prompt's greedy tokens are those of ``model.generate`` on it alone, whatever the
   number of processes; sampled outputs are seeded per prompt (``seed + prompt index``).

On a machine without GPUs, ``PartialState()`` sees no accelerator and treats each launched
process as a lone process (each would generate *every* prompt): :func:`make_state` passes
``cpu=True`` there, which makes the processes a gloo group. Note that in accelerate 1.15
``accelerate launch --cpu --num_processes 2`` starts a *single* process (its "simple launcher");
use ``accelerate launch --multi_gpu --num_processes 2`` (torch's elastic launcher, also on CPU) or
``torchrun --standalone --nproc_per_node 2``: :func:`make_state` warns when it detects the single-process case.

accelerate is an optional dependency (``pip install hf_paged[eval]``); it is imported lazily.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


logger = logging.getLogger(__name__)

_ACCELERATORS = ("xpu", "npu", "mlu", "musa", "sdaa", "hpu", "neuron")


def has_accelerator() -> bool:
    """True when accelerate would pick a multi-device backend (CUDA, XPU, NPU, ...), not gloo on CPU."""
    if torch.cuda.is_available():
        return True
    import accelerate.utils as au

    for name in _ACCELERATORS:
        check = getattr(au, f"is_{name}_available", None)
        try:
            if check is not None and check():
                return True
        except Exception:  # a probe that fails means: not usable here
            continue
    return False


def make_state(cpu: bool | None = None):
    """``accelerate.PartialState`` for the launched processes.

    ``cpu=None`` (default) means: CPU when no accelerator is present, or when ``accelerate launch
    --cpu`` set ``ACCELERATE_USE_CPU``. ``PartialState(cpu=True)`` is what turns processes started
    by ``torchrun`` / ``accelerate launch --multi_gpu`` on a CPU-only machine into one gloo group.
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    if cpu is None:
        cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not has_accelerator()
    state = PartialState(cpu=cpu)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if state.num_processes != world:
        raise RuntimeError(
            f"launched as {world} processes but accelerate formed a group of {state.num_processes}: every "
            "process would generate every prompt. On a machine without GPUs pass cpu=True.")
    if state.num_processes == 1 and "MASTER_ADDR" in os.environ and "WORLD_SIZE" not in os.environ:
        # accelerate's simple launcher sets MASTER_ADDR for --num_processes > 1 but starts one process
        logger.warning(
            "one process only: `accelerate launch --cpu --num_processes N` starts a single process in "
            "accelerate 1.x. Use `accelerate launch --multi_gpu --num_processes N` or "
            "`torchrun --standalone --nproc_per_node N` to start N processes (on CPU too).")
    return state


def deal(items: Sequence, num_processes: int) -> list:
    """Reorder ``items`` so that ``split_between_processes``' contiguous chunks deal them out in snake order.

    Items go to ranks in rounds of ``num_processes``: forwards (0, 1, ..., P-1), then backwards
    (P-1, ..., 0), and so on; the last, incomplete round goes forwards. With items sorted longest
    first this balances the ranks (rank 0 does not get the longest batch of every round), and the
    counts are exactly those of ``split_between_processes``: one each per full round, plus one for
    each of the first ``len(items) % P`` ranks. Rank r's chunk of the result is its share, in order.
    """
    if num_processes <= 0:
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    shares: list[list] = [[] for _ in range(num_processes)]
    full = len(items) - len(items) % num_processes
    for start in range(0, len(items), num_processes):
        ranks = range(num_processes)
        if start < full and (start // num_processes) % 2 == 1:
            ranks = reversed(ranks)
        for rank, item in zip(ranks, items[start:start + num_processes]):
            shares[rank].append(item)
    return [x for share in shares for x in share]


def share(state, items: Sequence) -> list:
    """This rank's share of ``items``: `deal`'s order through ``state.split_between_processes``, never padded
    (``apply_padding`` would give the short ranks a copy of the last item: a prompt generated twice)."""
    with state.split_between_processes(deal(items, state.num_processes)) as mine:
        return list(mine)


@dataclass
class DistributedGeneration:
    """What :func:`generate_distributed` returns, on every rank.

    ``results``: one dict per prompt, in input order: index, prompt, completion, tokens (new tokens
    generated, up to and including the first EOS), prompt_tokens.
    ``summary``: per-rank and total throughput and KV statistics (see :func:`generate_distributed`).
    """

    results: list[dict]
    summary: dict = field(default_factory=dict)


def _eos_ids(model, tokenizer) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def _input_device(model) -> torch.device:
    """Where inputs go: the input embeddings' device (the first device of a ``device_map``)."""
    try:
        return model.get_input_embeddings().weight.device
    except (AttributeError, NotImplementedError):
        return model.device


def generate_distributed(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 32,
    max_batch_tokens: int = 256,
    page_size: int = 16,
    max_pages: int | None = None,
    state=None,
    progress: bool = True,
    seed: int = 0,
    prefix_store=None,
    **sampling,
) -> DistributedGeneration:
    """Generate a completion for every prompt, the prompts spread over the launched processes.

    Call it on every process, with the same ``prompts``; each process passes its own ``model``
    (loaded with ``attn_implementation="hf_paged"``, on ``state.device``). Greedy unless ``sampling``
    says otherwise (``do_sample=True, temperature=..., top_k=..., top_p=...``, as for `generate_many`).

    Returns, on every rank, a :class:`DistributedGeneration` whose ``summary`` holds
    ``num_processes``, ``ranks`` (per rank: prompts, new_tokens, seconds, tokens_per_s, device, pid and
    ``kv``: the rank's page pool figures, peaks over its run, and with a prefix store its ``store_*`` counters)
    and ``total`` (new_tokens, wall seconds from the first to the last process, tokens_per_s, summed KV bytes).

    ``prefix_store``: a store every process reads and writes (a URI or folder each process opens, e.g. a folder on
    a shared file system or a Redis server; see docs/prefix_store.md): a prompt prefix one rank computed is loaded
    by the others instead of computed again. A store opened from a URI is flushed and closed at the end.
    """
    from accelerate.utils import gather_object

    from .continuous_batching import stream_many
    from .ragged_cache import RaggedCache

    if sampling.get("num_return_sequences", 1) != 1:
        raise ValueError("generate_distributed returns one completion per prompt: num_return_sequences must be 1 "
                         "(repeat a prompt in the list for more samples of it).")
    state = state if state is not None else make_state()
    prompts = list(prompts)
    token_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"] if prompts else []
    mine = share(state, sorted(range(len(prompts)), key=lambda i: (-len(token_ids[i]), i)))

    eos = _eos_ids(model, tokenizer)
    cache = RaggedCache(model.config, page_size=page_size, max_pages=max_pages, prefix_store=prefix_store)
    new = {i: [] for i in mine}
    peak_used = 0
    state.wait_for_everyone()
    wall_start = time.time()
    start = time.perf_counter()
    stream = stream_many(model, [token_ids[i] for i in mine], max_new_tokens=max_new_tokens, eos_token_id=sorted(eos),
                         max_batch_tokens=max_batch_tokens, cache=cache, seed=[seed + i for i in mine],  # global index:
                         progress=progress and state.is_main_process, **sampling)  # any number of ranks, the same draws
    for local, token in stream:
        new[mine[local]].append(token)
        peak_used = max(peak_used, cache.manager.num_used)
    seconds = time.perf_counter() - start
    wall_end = time.time()
    if cache.store_tier is not None:
        cache.store_tier.close()  # (flushes; closes a store this call opened)
    records = [dict(index=i, prompt=prompts[i], completion=tokenizer.decode(new[i], skip_special_tokens=True),
                    tokens=len(new[i]), prompt_tokens=len(token_ids[i])) for i in mine]
    page_bytes = cache.page_bytes()
    kv = dict(page_size=page_size, pages_total=cache.manager.num_pages, pool_bytes=cache.manager.num_pages * page_bytes,
              peak_pages_used=peak_used, peak_kv_bytes=peak_used * page_bytes, prefix_hits=cache.prefix_hits,
              **{k: v for k, v in cache.stats().items() if k.startswith("store_")})
    new_tokens = sum(r["tokens"] for r in records)
    rank = dict(rank=state.process_index, pid=os.getpid(), device=str(_input_device(model)), prompts=len(records),
                new_tokens=new_tokens, prompt_tokens=sum(r["prompt_tokens"] for r in records),
                seconds=seconds, tokens_per_s=new_tokens / seconds if seconds > 0 else 0.0,
                kv=kv, wall=(wall_start, wall_end))

    everything = gather_object(records)
    ranks = gather_object([rank])
    results: list[dict | None] = [None] * len(prompts)
    for r in everything:
        if results[r["index"]] is not None:
            raise RuntimeError(f"prompt {r['index']} was generated twice")
        results[r["index"]] = r
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise RuntimeError(f"prompts {missing[:10]} were not generated by any process")

    wall = max(r["wall"][1] for r in ranks) - min(r["wall"][0] for r in ranks)
    for r in ranks:
        del r["wall"]
    total_tokens = sum(r["new_tokens"] for r in ranks)
    summary = dict(
        num_processes=state.num_processes,
        distributed_type=str(state.distributed_type).split(".")[-1],
        backend=state.backend,
        num_prompts=len(prompts),
        max_batch_tokens=max_batch_tokens,
        max_new_tokens=max_new_tokens,
        page_size=page_size,
        greedy=not sampling.get("do_sample", False),
        ranks=sorted(ranks, key=lambda r: r["rank"]),
        total=dict(
            new_tokens=total_tokens,
            seconds=wall,
            tokens_per_s=total_tokens / wall if wall > 0 else 0.0,
            prompt_tokens=sum(r["prompt_tokens"] for r in ranks),
            peak_kv_bytes=sum(r["kv"]["peak_kv_bytes"] for r in ranks),
            pool_bytes=sum(r["kv"]["pool_bytes"] for r in ranks),
        ),
    )
    return DistributedGeneration(results=results, summary=summary)


def format_summary(summary: dict) -> str:
    """A few lines for humans: one per rank, then the total."""
    mib = 1 / 2**20
    lines = [f"{summary['num_prompts']} prompts, continuous batching (<= {summary['max_batch_tokens']} tokens a step), "
             f"{summary['num_processes']} process(es), {summary['distributed_type']} "
             f"(backend {summary['backend']}), page_size {summary['page_size']}"]
    for r in summary["ranks"]:
        kv = r["kv"]
        lines.append(
            f"  rank {r['rank']} ({r['device']}, pid {r['pid']}): {r['prompts']:4d} prompts "
            f"{r['new_tokens']:6d} new tokens in {r['seconds']:7.2f} s = {r['tokens_per_s']:8.1f} tok/s | KV peak "
            f"{kv['peak_pages_used']} pages, {kv['peak_kv_bytes'] * mib:.1f} MiB, pool {kv['pool_bytes'] * mib:.1f} MiB"
            + ("" if "store_hits" not in kv else
               f" | store: {kv['store_hits']} pages hit, {kv['store_misses']} missed, {kv['store_pages_written']} "
               f"written, {kv['store_bytes_read'] * mib:.1f} MiB read in {kv['store_load_seconds']:.2f} s, "
               f"{kv['store_recomputed']} loads skipped"))
    t = summary["total"]
    lines.append(f"  total: {t['new_tokens']} new tokens in {t['seconds']:.2f} s = {t['tokens_per_s']:.1f} tok/s | "
                 f"KV peak {t['peak_kv_bytes'] * mib:.1f} MiB, pools {t['pool_bytes'] * mib:.1f} MiB")
    return "\n".join(lines)
