"""Data-parallel generation over a prompt set with accelerate: one model and one `PagedCache` per process.

Launch a script that calls :func:`generate_distributed` with ``accelerate launch`` (or ``torchrun``):
every process loads the model on its own device (``state.device``), generates its share of the
prompts and all processes exchange the results with ``accelerate.utils.gather_object``, so every
rank returns every prompt's completion, in input order.

How the work is split, and why a run on N processes gives the same greedy output as a run on one:

1. every prompt is tokenized once and the prompts are sorted by length (longest first), then cut
   into batches of ``batch_size``: batches hold prompts of similar length, so little padding;
2. the *batches* (not the prompts) are dealt to the processes in snake order (see :func:`deal`), through
   ``PartialState.split_between_processes`` (without ``apply_padding``, which would repeat the last
   item on the short ranks); a prompt is therefore generated in the same batch, with the same
   padding and the same neighbours, whatever the number of processes: the numbers are the same;
3. each process reuses one `PagedCache` for its batches (``cache.reset()`` in between), so its KV
   pool is allocated once and grows to the largest batch only.

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

from .cache import CACHE_KWARG, PagedCache

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


def plan_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Prompt indices sorted by length, longest first (ties: input order), cut into batches."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


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


def _trim(ids: list[int], eos: set[int]) -> list[int]:
    for n, t in enumerate(ids):
        if t in eos:
            return ids[: n + 1]
    return ids


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
    batch_size: int = 8,
    max_new_tokens: int = 32,
    page_size: int = 16,
    max_pages: int | None = None,
    state=None,
    progress: bool = True,
    seed: int = 0,
    **generate_kwargs,
) -> DistributedGeneration:
    """Generate a completion for every prompt, the prompts spread over the launched processes.

    Call it on every process, with the same ``prompts``; each process passes its own ``model``
    (already on ``state.device``, or placed with a ``device_map``). Greedy unless
    ``generate_kwargs`` says otherwise (``do_sample=True, temperature=...``); with sampling, the
    RNG is seeded with ``seed + batch number`` before each batch, so the output does not depend on
    the number of processes either.

    Returns, on every rank, a :class:`DistributedGeneration` whose ``summary`` holds
    ``num_processes``, ``ranks`` (per rank: prompts, batches, new_tokens, seconds, tokens_per_s,
    device, pid and ``kv``: the rank's `PagedCache` figures, peaks over its batches) and ``total``
    (new_tokens, wall seconds from the first to the last process, tokens_per_s, summed KV bytes).
    """
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    state = state if state is not None else make_state()
    prompts = list(prompts)
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer needs a pad token (e.g. tokenizer.pad_token = tokenizer.eos_token)")
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"]] if prompts else []
    batches = plan_batches(lengths, batch_size)
    numbered = list(enumerate(batches))  # global batch number: seeds sampling, independent of ranks
    with state.split_between_processes(deal(numbered, state.num_processes)) as mine:
        mine = list(mine)

    gen = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    gen.update(generate_kwargs)
    eos = _eos_ids(model, tokenizer)
    device = _input_device(model)
    cache = PagedCache(page_size=page_size, max_pages=max_pages, config=model.config)
    kv = dict(page_size=page_size, pages_total=0, pool_bytes=0, peak_pages_used=0, peak_tokens_stored=0,
              peak_kv_bytes=0, evictions=0, prefix_hits=0)
    records: list[dict] = []
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only batched generation
    bar = tqdm(total=sum(len(b) for _, b in mine), unit="prompt", disable=not (progress and state.is_main_process),
               desc=f"rank 0/{state.num_processes}")
    state.wait_for_everyone()
    wall_start = time.time()
    start = time.perf_counter()
    try:
        for number, batch in mine:
            enc = tokenizer([prompts[i] for i in batch], return_tensors="pt", padding=True).to(device)
            if gen.get("do_sample"):
                torch.manual_seed(seed + number)
            out = model.generate(**enc, **{CACHE_KWARG: cache}, **gen)
            width = enc["input_ids"].shape[1]
            new = out[:, width:].tolist()
            for row, i in enumerate(batch):
                ids = _trim(new[row], eos)
                records.append(dict(index=i, prompt=prompts[i],
                                    completion=tokenizer.decode(ids, skip_special_tokens=True),
                                    tokens=len(ids), prompt_tokens=lengths[i]))
            s = cache.stats()
            kv["peak_pages_used"] = max(kv["peak_pages_used"], s["pages_used"])
            kv["peak_tokens_stored"] = max(kv["peak_tokens_stored"], s["tokens_stored"])
            kv["peak_kv_bytes"] = max(kv["peak_kv_bytes"], s["kv_bytes"])
            cache.reset()
            bar.update(len(batch))
    finally:
        tokenizer.padding_side = padding_side
        bar.close()
    seconds = time.perf_counter() - start
    wall_end = time.time()
    s = cache.stats()
    kv.update(pages_total=s["pages_total"], pool_bytes=s["pool_bytes"], evictions=s["evictions"],
              prefix_hits=s["prefix_hits"])
    new_tokens = sum(r["tokens"] for r in records)
    rank = dict(rank=state.process_index, pid=os.getpid(), device=str(device), prompts=len(records),
                batches=len(mine), new_tokens=new_tokens,
                padded_prompt_tokens=sum(len(b) * lengths[b[0]] for _, b in mine),
                prompt_tokens=sum(r["prompt_tokens"] for r in records),
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
        num_batches=len(batches),
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        page_size=page_size,
        greedy=not gen.get("do_sample", False),
        ranks=sorted(ranks, key=lambda r: r["rank"]),
        total=dict(
            new_tokens=total_tokens,
            seconds=wall,
            tokens_per_s=total_tokens / wall if wall > 0 else 0.0,
            prompt_tokens=sum(r["prompt_tokens"] for r in ranks),
            padded_prompt_tokens=sum(r["padded_prompt_tokens"] for r in ranks),
            peak_kv_bytes=sum(r["kv"]["peak_kv_bytes"] for r in ranks),
            pool_bytes=sum(r["kv"]["pool_bytes"] for r in ranks),
        ),
    )
    return DistributedGeneration(results=results, summary=summary)


def format_summary(summary: dict) -> str:
    """A few lines for humans: one per rank, then the total."""
    mib = 1 / 2**20
    lines = [f"{summary['num_prompts']} prompts in {summary['num_batches']} batches of <= {summary['batch_size']}, "
             f"{summary['num_processes']} process(es), {summary['distributed_type']} "
             f"(backend {summary['backend']}), page_size {summary['page_size']}"]
    for r in summary["ranks"]:
        kv = r["kv"]
        lines.append(
            f"  rank {r['rank']} ({r['device']}, pid {r['pid']}): {r['prompts']:4d} prompts {r['batches']:3d} batches "
            f"{r['new_tokens']:6d} new tokens in {r['seconds']:7.2f} s = {r['tokens_per_s']:8.1f} tok/s | KV peak "
            f"{kv['peak_pages_used']} pages, {kv['peak_kv_bytes'] * mib:.1f} MiB, pool {kv['pool_bytes'] * mib:.1f} MiB")
    t = summary["total"]
    pad = 1 - t["prompt_tokens"] / t["padded_prompt_tokens"] if t["padded_prompt_tokens"] else 0.0
    lines.append(f"  total: {t['new_tokens']} new tokens in {t['seconds']:.2f} s = {t['tokens_per_s']:.1f} tok/s | "
                 f"KV peak {t['peak_kv_bytes'] * mib:.1f} MiB, pools {t['pool_bytes'] * mib:.1f} MiB | "
                 f"prompt padding {100 * pad:.1f}%")
    return "\n".join(lines)
