"""hf_paged.assets: the offline text (fast) and the real SmolLM2 weights (slow)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from hf_paged import assets  # noqa: E402


def test_import_is_cheap():  # (hf_paged/__init__ itself needs transformers)
    code = "import sys, hf_paged.assets; print(sorted({'datasets', 'gguf'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_britannica_text_is_clean_prose():
    text = assets.britannica_text()
    lines = text.splitlines()
    assert not [l for l in lines if l.lstrip().startswith("#")]
    assert not re.search(r"\bp\.\d+:\d", text)
    assert "[^" not in text and "[[ed:" not in text and "http" not in text
    assert len(text.split()) >= 4000  # >= 4000 tokens' worth of words (it has ~33k)
    assert text.startswith("Shakespeare, William (1564--1616)")
    assert "Shake- speare" not in text and "Shakespeare" in text  # line-break hyphens rejoined
    paragraphs = text.split("\n\n")
    assert len(paragraphs) > 50 and all(p.strip() and "\n" not in p for p in paragraphs)


def test_britannica_dataset_rows():
    ds = assets.britannica_dataset()
    assert ds.column_names == ["text"]
    assert len(ds) == len(assets.britannica_text().split("\n\n"))
    assert all(row["text"].strip() for row in ds)
    assert assets.load_text_dataset()["text"] == ds["text"]


def test_britannica_prompts_deterministic_distinct_varied():
    prompts = assets.britannica_prompts(32, min_words=10, max_words=80, seed=3)
    assert prompts == assets.britannica_prompts(32, min_words=10, max_words=80, seed=3)
    assert prompts != assets.britannica_prompts(32, min_words=10, max_words=80, seed=4)
    assert len(prompts) == 32 and len(set(prompts)) == 32
    lengths = [len(p.split()) for p in prompts]
    assert min(lengths) >= 10 and max(lengths) <= 80 and len(set(lengths)) > 10
    assert all(p[0].isupper() for p in prompts)  # cut at sentence starts
    with pytest.raises(ValueError):
        assets.britannica_prompts(2, min_words=50, max_words=10)


def test_load_text_dataset_from_file(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("First paragraph,\nwrapped.\n\nSecond one.\n\n\nThird.\n", encoding="utf-8")
    ds = assets.load_text_dataset(text_file=str(path))
    assert ds.column_names == ["text"]
    assert [t.strip() for t in ds["text"]] == ["First paragraph,\nwrapped.", "Second one.", "Third."]
    with pytest.raises(ValueError, match=r"'content'.*\['text'\]"):
        assets.load_text_dataset(text_file=str(path), column="content")


def test_resolve_model_path_passthrough_and_cache_dir(tmp_path, monkeypatch):
    assert assets.resolve_model_path("some-org/some-model") == "some-org/some-model"
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(tmp_path))
    assert assets.cache_dir() == tmp_path


def test_conversion_is_atomic_and_tolerates_a_concurrent_winner(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(tmp_path))
    target = tmp_path / "SmolLM2-135M-Instruct.Q4_1"
    calls = []

    def fake_convert(out_dir):  # meanwhile another process finishes first
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        target.mkdir()
        (target / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(assets, "_convert_gguf", fake_convert)
    assert assets.resolve_model_path() == str(target)
    assert (target / "config.json").read_text() == '{"winner": true}'
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # temp folder cleaned up
    assert assets.resolve_model_path("smollm2") == str(target) and len(calls) == 1  # cached now

    def failing_convert(out_dir):
        raise RuntimeError("boom")

    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(tmp_path / "other"))
    monkeypatch.setattr(assets, "_convert_gguf", failing_convert)
    with pytest.raises(RuntimeError, match="boom"):
        assets.resolve_model_path()
    assert list((tmp_path / "other").iterdir()) == []  # no half-written folder left behind


@pytest.mark.slow
def test_real_smollm2_loads_and_generates():
    """Uses the real cache ($HF_PAGED_CACHE_DIR or ~/.cache/hf_paged): ~30 s the first time, ~1 s after."""
    import torch

    model, tok = assets.load_model_and_tokenizer()
    assert Path(assets.resolve_model_path(), "model.safetensors").is_file()
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 30
    assert cfg.num_attention_heads == 9 and cfg.num_key_value_heads == 3
    assert model.dtype == torch.float32 and not model.training
    assert tok.pad_token is not None and tok.padding_side == "left"
    enc = tok(["The capital of France is", "Shakespeare was born in"], return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert all(t.strip() for t in texts)
    assert "Paris" in texts[0]


def test_missing_packages_name_the_install_line(monkeypatch, tmp_path):
    real = assets.importlib.util.find_spec
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(ModuleNotFoundError, match="gguf") as err:
        assets._convert_gguf(tmp_path)
    assert assets.INSTALL_LINE in str(err.value) and '".[assets]"' in assets.INSTALL_LINE
    with pytest.raises(ModuleNotFoundError, match="no_such_asset_package") as err:
        assets._package_dir("no_such_asset_package")
    assert assets.INSTALL_LINE in str(err.value)
    assert not list(tmp_path.iterdir())  # nothing converted
