"""scripts/vllm_runner.py and its caller's side (`hf_paged.evaluation.vllm_peer.VllmPeer`), with a stand-in for vLLM.

The stand-in (a ``vllm`` package written into a temporary folder) "generates" token ``prompt[-1] + k`` at step
k, so the test checks what the runner hands back, not vLLM's numbers; vLLM itself runs in
scripts/many_prompts.py when ``.venv-vllm`` exists.
"""

import sys
import textwrap

import pytest

from hf_paged.evaluation.vllm_peer import VllmPeer

FAKE_VLLM = textwrap.dedent('''
    __version__ = "0.0-stand-in"

    class SamplingParams:
        def __init__(self, temperature, max_tokens, min_tokens, ignore_eos):
            assert temperature == 0.0 and min_tokens == max_tokens and ignore_eos
            self.max_tokens = max_tokens

    class _Out:
        def __init__(self, request_id, token_ids, finished):
            self.request_id, self.finished = request_id, finished
            self.outputs = [type("Completion", (), {"token_ids": token_ids})()]

    class _Engine:
        def __init__(self):
            self.requests = {}

        def add_request(self, request_id, prompt, params):
            self.requests[request_id] = (prompt["prompt_token_ids"], params.max_tokens, [])

        def has_unfinished_requests(self):
            return any(len(done) < n for _, n, done in self.requests.values())

        def step(self):
            outs = []
            for request_id, (ids, n, done) in list(self.requests.items()):
                if len(done) < n:
                    done.append(ids[-1] + len(done))
                    outs.append(_Out(request_id, list(done), len(done) == n))
            return outs

    class LLM:
        def __init__(self, model, dtype, **kwargs):
            assert dtype == "float32" and kwargs["max_model_len"] >= 1
            self.llm_engine = _Engine()

        def reset_prefix_cache(self):
            self.llm_engine.requests.clear()
''')


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def test_peer_serves_passes_on_demand_with_every_prompts_tokens(fake_vllm):
    prompts, wanted = [[5, 6, 7], [40], [9, 10]], [3, 1, 4]
    peer, status = VllmPeer.start(sys.executable, "some/model", prompts, wanted, threads=1, timeout_s=120)
    assert status == "ok", status
    try:
        for _ in range(2):
            answer = peer.run_pass(timeout_s=120)
            assert answer["outputs"] == [[7, 8, 9], [40], [10, 11, 12, 13]]
            assert answer["cpu_s"] >= 0 and answer["wall_s"] >= 0 and all(t is not None for t in answer["ttft"])
            assert answer["versions"]["vllm"] == "0.0-stand-in" and answer["versions"]["threads"] == 1
    finally:
        peer.close()
    assert peer.proc.returncode == 0


def test_absent_or_switched_off_environment_is_reported_not_raised(tmp_path):
    assert VllmPeer.start("off", "m", [[1]], [1], threads=1) == (None, "not run (off)")
    peer, status = VllmPeer.start(str(tmp_path / "no-python"), "m", [[1]], [1], threads=1)
    assert peer is None and status.startswith("not run (") and "absent" in status and "make_vllm_env.sh" in status


def test_a_runner_that_fails_to_start_is_reported_with_its_log(tmp_path, monkeypatch):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('no vllm here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    peer, status = VllmPeer.start(sys.executable, "m", [[1]], [1], threads=1, timeout_s=120)
    assert peer is None and status.startswith("failed to start") and "no vllm here" in status
