"""Perplexity of texts computed through hf_paged's PagedCache, as an `evaluate` metric.

Load it from this folder (offline; evaluate looks for ``<folder>/<folder name>.py``, so the file
must keep the folder's name), with hf_paged installed:

    import evaluate
    metric = evaluate.load("/abs/path/to/integrations/perplexity_metric")
    metric.compute(predictions=["The first text.", "Another one."], model_id="smollm2")
    # {"perplexities": [...], "mean_perplexity": ...}

Each text is tokenized on its own (the tokenizer's own special tokens; ``add_start_token=True``, the
default as in evaluate's "perplexity" metric, prepends BOS so that the text's first token is scored
too), cut to ``max_length`` tokens, and every token after the first is scored. Texts are
batched ``batch_size`` at a time, right-padded (a real token never attends to a pad, so padding
changes nothing), through one ``PagedCache(page_size, max_pages, eviction=...)`` per batch on a
model loaded with ``attn_implementation="hf_paged"``:

- ``max_pages=None`` (unbounded): one forward per batch; equals DynamicCache up to float noise;
- ``max_pages=N``: the batch streams through the cache in chunks of ``chunk_size`` tokens
  (default: one page), each token scored given what the cache still holds (StreamingLLM-style);
  when a text outgrows the budget, the eviction policy drops pages (``eviction="fifo"`` / ``"lru"`` /
  ``"score"``, ``sink_pages`` / ``recent_pages`` / ``lru_threshold``); ``eviction="error"`` raises instead.
  The pool is shared by the rows of a batch, and each row keeps its sink and recent pages: a batch
  needs about ``batch_size * (sink_pages + recent_pages + 1)`` pages (lower ``batch_size`` for a
  per-text budget), else ``PagePoolExhausted``.

``model_id``: "smollm2" (the embedded SmolLM2-135M, see ``hf_paged.assets``), a local folder or a
hub id. Models are loaded once per (model_id, device, dtype) and kept for later calls.
"""

import math

import datasets
import evaluate
import torch

import hf_paged
from hf_paged import assets
from hf_paged.evaluation.nll import CacheStream

_DESCRIPTION = __doc__
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): the texts to score.
    model_id (str): "smollm2" (default), a local folder or a hub id of a causal LM.
    page_size (int): tokens per KV page (default 16).
    max_pages (int or None): bound of the page pool (None: unbounded).
    eviction (str or None): "fifo", "lru", "score" or "error" when max_pages is set (None: PagedCache's default).
    sink_pages, recent_pages, lru_threshold: eviction policy arguments (None: PagedCache's defaults).
    chunk_size (int or None): tokens per forward (None: the whole batch when unbounded, one page when bounded).
    batch_size (int): texts per forward (default 8).
    max_length (int or None): keep the first max_length tokens of each text (None: all).
    add_start_token (bool): prepend the tokenizer's BOS token, so that the first real token is scored too
        (default True, as in evaluate's "perplexity" metric; False for a tokenizer without BOS).
    device (str or None): default "cuda" when available, else "cpu".
    dtype (str): "float32" (default), "bfloat16" or "float16".
Returns:
    perplexities (list of float): one per text, exp(mean NLL of its scored tokens).
    mean_perplexity (float): their mean.
"""
_CITATION = ""
_MODELS = {}


def _load(model_id, device, dtype):
    key = (model_id, device, dtype)
    if key not in _MODELS:
        _MODELS[key] = assets.load_model_and_tokenizer(model_id, dtype=assets.DTYPES[dtype], device=device,
                                                       attn_implementation=hf_paged.ATTN_IMPLEMENTATION)
    return _MODELS[key]


class PerplexityMetric(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
            reference_urls=["https://huggingface.co/docs/transformers/perplexity"],
        )

    def _compute(self, predictions, model_id="smollm2", page_size=16, max_pages=None, eviction=None,
                 batch_size=8, max_length=None, add_start_token=True, sink_pages=None, recent_pages=None,
                 lru_threshold=None, chunk_size=None, device=None, dtype="float32"):
        _check_arguments(predictions, page_size=page_size, max_pages=max_pages, batch_size=batch_size,
                         max_length=max_length, chunk_size=chunk_size)
        if dtype not in assets.DTYPES:
            raise ValueError(f"dtype must be one of {sorted(assets.DTYPES)}, got {dtype!r}")
        policy = dict(eviction=eviction, sink_pages=sink_pages, recent_pages=recent_pages, lru_threshold=lru_threshold)
        policy = {k: v for k, v in policy.items() if v is not None}
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer = _load(model_id, device, dtype)

        encoded = []
        for i, text in enumerate(predictions):
            ids = tokenizer(text, verbose=False).input_ids
            if add_start_token:
                if tokenizer.bos_token_id is None:
                    raise ValueError("add_start_token=True but the tokenizer has no BOS token: "
                                     "pass add_start_token=False")
                if not ids or ids[0] != tokenizer.bos_token_id:
                    ids = [tokenizer.bos_token_id] + ids
            if max_length is not None:
                ids = ids[:max_length]
            if len(ids) < 2:
                raise ValueError(f"prediction {i} has {len(ids)} token(s): at least 2 are needed to score one")
            encoded.append(ids)

        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))  # little padding per batch
        perplexities = [None] * len(encoded)
        for b in range(0, len(order), batch_size):
            rows = order[b:b + batch_size]
            lengths = torch.tensor([len(encoded[i]) for i in rows])
            ids = torch.full((len(rows), int(lengths.max())), pad_id, dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, :len(encoded[i])] = torch.tensor(encoded[i])
            cache = hf_paged.PagedCache(page_size=page_size, max_pages=max_pages, config=model.config, **policy)
            chunk = chunk_size or (page_size if max_pages is not None else ids.shape[1])
            nll = CacheStream(model, cache, hf_paged.CACHE_KWARG).score(ids, chunk)
            real = torch.arange(1, ids.shape[1])[None] < lengths[:, None]  # the target is a real token, not a pad
            sums, counts = (nll * real).sum(1).tolist(), real.sum(1).tolist()
            for r, i in enumerate(rows):
                perplexities[i] = math.exp(sums[r] / counts[r])
        return {"perplexities": perplexities, "mean_perplexity": sum(perplexities) / len(perplexities)}


def _check_arguments(predictions, **sizes) -> None:
    """Refuse, before a model is loaded, what would fail later with a ZeroDivisionError or an empty result."""
    if len(predictions) == 0:
        raise ValueError("predictions is empty: give at least one text to score.")
    least = {"page_size": 1, "batch_size": 1, "max_pages": 1, "chunk_size": 1, "max_length": 2}
    optional = ("max_pages", "chunk_size", "max_length")
    for name, value in sizes.items():
        if value is None and name in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least[name]:
            raise ValueError(f"{name} must be {'None or ' if name in optional else ''}an int of at least "
                             f"{least[name]}, got {value!r}.")
