"""Scoring a token sequence through one cache: every next token's negative log-likelihood (NLL).

`CacheStream` feeds a cache in order, in chunks, each forward at explicit positions that continue the count of
tokens processed, so a cache that holds fewer tokens than it processed (evicted, compressed) keeps every later
position right. This is the one loop behind streaming perplexity (`hf_paged.evaluation.perplexity`), the
`evaluate` metric (integrations/perplexity_metric), the long-context tasks (`hf_paged.evaluation.long_context`)
and kvpress's side of them (scripts/kvpress_runner.py).

Imports nothing but torch: kvpress_runner.py loads this file by path in kvpress's own environment (an older
transformers, without hf_paged's cache); there the cache keyword is ``past_key_values``.
"""

from __future__ import annotations

import math

import torch


def perplexity(nll_sum: float, tokens: int) -> float:
    """exp(mean NLL) of ``tokens`` tokens whose NLL adds up to ``nll_sum`` (NaN for no tokens)."""
    return math.exp(nll_sum / tokens) if tokens else float("nan")


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position, float64: ``logits [..., V]``, ``targets [...]``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -logprobs.gather(-1, targets[..., None])[..., 0].double()


class CacheStream:
    """One cache fed a token sequence in order through ``model``. Invariant: ``position`` = tokens fed so far (the
    same for every row), and the next forward's tokens sit at positions ``position, position + 1, ...``.

    ``cache_kwarg``: the keyword the model's forward takes the cache under (``hf_paged.CACHE_KWARG``);
    ``after_forward``: called after every forward (e.g. to read how much the cache holds).
    """

    def __init__(self, model, cache, cache_kwarg: str = "cache", after_forward=None):
        self.model, self.cache, self.cache_kwarg, self.after_forward = model, cache, cache_kwarg, after_forward
        self.position = 0

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """One forward of ``ids [B, T]`` at the next positions; -> logits ``[B, T, V]``."""
        batch, length = ids.shape
        device = self.model.device
        positions = torch.arange(self.position, self.position + length, device=device)[None].expand(batch, -1)
        logits = self.model(input_ids=ids.to(device), position_ids=positions, use_cache=True,
                            **{self.cache_kwarg: self.cache}).logits
        self.position += length
        if self.after_forward is not None:
            self.after_forward()
        return logits

    def feed(self, ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """Forward ``ids [B, T]`` in chunks of ``chunk`` tokens (all at once when None); -> the last token's logits
        ``[B, V]``."""
        step = chunk or ids.shape[1]
        for start in range(0, ids.shape[1], step):
            logits = self.forward(ids[:, start:start + step])
        return logits[:, -1]

    def score(self, ids: torch.Tensor, chunk: int | None = None, bar=None) -> torch.Tensor:
        """Feed ``ids[:, :-1]`` in chunks of ``chunk`` tokens (all at once when None); -> the NLL of every next token
        ``ids[:, 1:]`` given what the cache holds when it is predicted, ``[B, T - 1]`` float64 on the CPU.
        ``bar`` (a tqdm bar) advances by the tokens scored."""
        n = ids.shape[1]
        nll = torch.empty(ids.shape[0], n - 1, dtype=torch.float64)
        step = chunk or n - 1
        for start in range(0, n - 1, step):
            end = min(start + step, n - 1)
            logits = self.forward(ids[:, start:end])
            nll[:, start:end] = token_nll(logits, ids[:, start + 1:end + 1].to(logits.device)).cpu()
            if bar is not None:
                bar.update(end - start)
        return nll

    def log_probs(self, ids: torch.Tensor, chunk: int) -> torch.Tensor:
        """Feed one row's ``ids [T]`` in chunks of ``chunk`` tokens; -> the float32 log-probabilities ``[T - 1, V]``
        of every next token given what the cache holds when it is predicted."""
        out = [torch.log_softmax(self.forward(ids[None, start:start + chunk])[0].float(), dim=-1).cpu()
               for start in range(0, len(ids), chunk)]
        return torch.cat(out)[:-1]

    def score_after(self, logits: torch.Tensor, ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """The NLL of every token of one row's ``ids [T]``, the first given the previous token's ``logits [V]``
        (e.g. `feed`'s), the others as `score` feeds them; -> ``[T]`` float64 on the CPU."""
        first = token_nll(logits, ids[0].to(logits.device)).cpu()
        return torch.cat([first[None], self.score(ids[None], chunk)[0]])

    def greedy(self, logits: torch.Tensor, new_tokens: int) -> list[int]:
        """Greedy decoding of one row from its last token's ``logits [V]``: ``new_tokens`` ids, each fed back."""
        out = []
        for _ in range(new_tokens):
            out.append(int(logits.argmax()))
            logits = self.forward(torch.tensor([out[-1:]]))[0, -1]
        return out
