"""The README stays a short user's document, and every python block in it (and in docs/metric.md) runs as written.

A block preceded by ``<!-- readme-test: slow -->`` needs the real embedded model: the slow tier runs it as
written; the fast tier runs the same code with the model name ``"smollm2"`` replaced by the folder of a tiny
random-weight Llama and a byte-level tokenizer (what the code calls is the same; what it prints is noise).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/metric.md")  # the pages whose python blocks are run
MAX_README_LINES = 250
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<mark>[a-z]+) -->\n)?```python\n(?P<code>.*?)^```", re.S | re.M)
MODEL_NAME = '"smollm2"'

pytestmark = pytest.mark.usefixtures("one_thread")


def python_blocks(document: str) -> list[tuple[str, str, bool]]:
    """(``document:line``, code, needs the real model) of every python block of ``document``."""
    text = (ROOT / document).read_text(encoding="utf-8")
    blocks = []
    for match in BLOCK.finditer(text):
        if match["mark"] not in (None, "slow"):
            raise ValueError(f"{document}: unknown readme-test mark {match['mark']!r} (expected 'slow')")
        line = text.count("\n", 0, match.start("code")) + 1
        blocks.append((f"{document}:{line}", match["code"], match["mark"] == "slow"))
    return blocks


BLOCKS = [block for document in DOCUMENTS for block in python_blocks(document)]


def test_readme_is_short_and_has_python_blocks():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; keep it to {MAX_README_LINES}"
    assert len(python_blocks("README.md")) >= 3


def test_slow_blocks_name_the_model_the_fast_tier_replaces():
    """Every block marked slow loads the embedded model by its name, so the fast tier has something to replace."""
    for where, code, slow in BLOCKS:
        assert not slow or MODEL_NAME in code, f"{where}: marked slow but does not name {MODEL_NAME}"


def run_block(where: str, code: str, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # blocks name repository paths (integrations/...) relative to the root
    exec(compile(code, where, "exec"), {"__name__": "__readme_block__"})


@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory) -> Path:
    """A tiny random Llama with a byte-level tokenizer (256 bytes + 3 special tokens), saved as a model folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny_llama")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", *sorted(alphabet)])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                                     eos_token="</s>")
    tokenizer.save_pretrained(folder)
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("where, code, slow", BLOCKS, ids=[where for where, _, _ in BLOCKS])
def test_block_runs_on_a_tiny_model(where, code, slow, tiny_model_folder, monkeypatch):
    if slow:
        code = code.replace(MODEL_NAME, repr(str(tiny_model_folder)))
    run_block(where, code, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("where, code", [(where, code) for where, code, slow in BLOCKS if slow],
                         ids=[where for where, _, slow in BLOCKS if slow])
def test_block_runs_as_written(where, code, monkeypatch):
    run_block(where, code, monkeypatch)


def test_docs_cite_every_stored_result_and_nothing_missing():
    """Every folder of results/ is cited by the README or a docs page (with the command that regenerates it), and
    every results/ path they cite exists: stored runs that only record history are pruned (git keeps them)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n".join(page.read_text(encoding="utf-8") for page in pages)
    cited = {Path(path.rstrip("/.")) for path in re.findall(r"(?<![\w/])results/[\w./-]*[\w/]", text)}
    stored = {path.parent.relative_to(ROOT) for path in (ROOT / "results").rglob("*.json")}
    uncited = sorted(str(folder) for folder in stored if not any(path.is_relative_to(folder) for path in cited))
    assert not uncited, f"stored results no page cites: {uncited}"
    missing = sorted(str(path) for path in cited if not (ROOT / path).exists())
    assert not missing, f"cited but not stored: {missing}"
