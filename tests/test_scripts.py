"""The scripts' shared module and structure (fast: nothing here loads a model)."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import common

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_import_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("gpu_check_script", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py"])  # no --out: a parse at import would exit here
    spec.loader.exec_module(module)
    assert [p.__name__ for p in module.PARTS] == ["copy_bandwidth", "decode_kernel", "end_to_end", "split_model"]
    assert not list(tmp_path.iterdir())


def test_common_int_list_and_mib():
    assert common.int_list("256, 1024") == [256, 1024]
    for bad in ("", "0", "-1", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.int_list(bad)
    assert common.mib(3 * 2**19) == "1.5" and common.mib(2**20, 2) == "1.00"


def test_common_dynamic_kv_bytes_counts_keys_and_values():
    from transformers import DynamicCache

    cache = DynamicCache()
    k = torch.zeros(2, 3, 5, 4)
    for layer in range(2):
        cache.update(k, k.clone(), layer)
    assert common.dynamic_kv_bytes(cache) == 2 * 2 * k.numel() * k.element_size()
