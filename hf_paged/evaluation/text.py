"""A text as token ids: the embedded Britannica article, a ``datasets`` dataset or a local text file."""

from __future__ import annotations

import torch

from .. import assets

EMBEDDED = "britannica (embedded, hf_paged.assets)"


def load_token_ids(tokenizer, max_tokens: int = 0, dataset: str | None = None, config: str | None = None,
                   split: str = "train", column: str = "text",
                   text_file: str | None = None) -> tuple[torch.Tensor, dict]:
    """The documents joined with "\\n\\n", tokenized once, cut to ``max_tokens`` (0: all): (1-D ids, info).

    The source is `hf_paged.assets.load_text_dataset`'s (default: the embedded Britannica article). With a token
    limit only a prefix of the documents is tokenized (16 characters per wanted token, doubled until the limit is
    reached), so a large dataset is not tokenized whole. ``info`` names the source and counts documents and tokens.
    """
    ds = assets.load_text_dataset(dataset, config, split=split, column=column, text_file=text_file)
    docs = [t for t in ds[column] if isinstance(t, str) and t.strip()]
    if not docs:
        raise ValueError(f"no non-empty text in column {column!r}")
    chars = 16 * max_tokens if max_tokens else None
    while True:
        used, total = [], 0
        for doc in docs:
            if chars is not None and total >= chars:
                break
            used.append(doc)
            total += len(doc) + 2
        text = "\n\n".join(used)
        ids = tokenizer(text, return_tensors="pt", verbose=False).input_ids[0]
        if chars is None or len(ids) >= max_tokens or len(used) == len(docs):
            break
        chars *= 2
    if max_tokens:
        ids = ids[:max_tokens]
    info = dict(source=text_file or dataset or EMBEDDED, config=config,
                split=None if text_file or not dataset else split, column=column, documents_total=len(docs),
                documents_used=len(used), chars_tokenized=len(text), tokens=len(ids))
    return ids, info
