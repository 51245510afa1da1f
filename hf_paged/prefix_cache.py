"""Prefix caching: content hashes of full pages, and the model hook that reuses them.

A cache bound to a model (``PagedCache(model=model)``) sees every forward's ``input_ids`` and
``attention_mask`` through a forward pre-hook. It logs them per row, so each full page gets a
chained content hash: ``h_i = sha256(h_{i-1} || tokens_i || mask_i)`` (the mask is part of the
content: it changes positions and what earlier tokens see), rooted at ``h_{-1}``, a fingerprint
of what computed the K/V (`model_fingerprint`: model class, config, dtype, devices, sampled
weights, page size, layer windows), so pages never match across models. The hash is stable across
processes. When a forward starts on an empty cache, the hook looks the prompt's pages up,
shares the longest page-aligned prefix found for every row of every layer group, and trims
the inputs so that only the new tokens are computed: ``model.generate(**inputs, cache=cache)``
stays one line.
"""

from __future__ import annotations

import hashlib

import torch

_HOOKED = "_hf_paged_prefix_hook"


def page_hashes(tokens: list[int], mask: list[int], page_size: int, start: int, parent: bytes) -> list[bytes]:
    """Chained hashes of the full pages of ``tokens`` from page ``start`` on (``parent``: the hash before)."""
    hashes = []
    for i in range(start, len(tokens) // page_size):
        sl = slice(i * page_size, (i + 1) * page_size)
        digest = hashlib.sha256(parent)
        digest.update(torch.tensor(tokens[sl], dtype=torch.int64).numpy().tobytes())
        digest.update(bytes(mask[sl]))
        parent = digest.digest()
        hashes.append(parent)
    return hashes


def model_fingerprint(model: torch.nn.Module, page_size: int, windows: list) -> bytes:
    """What computed a cache's K/V, as the root of its pages' hash chains: the model's class, config,
    parameter shapes, dtypes and devices, four sampled values of every parameter (one transfer),
    the page size and the layers' windows. Two models that differ in any of these never share pages."""
    digest = hashlib.sha256(type(model).__qualname__.encode())
    digest.update(model.config.to_json_string(use_diff=False).encode())
    digest.update(repr((page_size, windows)).encode())
    samples = []
    for name, param in model.named_parameters():
        digest.update(f"{name} {tuple(param.shape)} {param.dtype} {param.device}".encode())
        flat = param.detach().reshape(-1)
        if flat.numel() and flat.device.type != "meta":
            n = flat.numel()
            samples.append(flat[torch.tensor([0, n // 3, (2 * n) // 3, n - 1], device=flat.device)].float().cpu())
    if samples:
        digest.update(torch.cat(samples).numpy().tobytes())
    return digest.digest()


class TokenLog:
    """Per row: the tokens and mask bits processed so far, and the hashes of its full pages.

    Invariant: ``len(hashes[b]) == len(tokens[b]) // page_size`` after `extend` (hashes of pages
    that are full), chained from ``root`` (the fingerprint of the model that computes the rows).
    """

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = b""
        self.tokens: list[list[int]] = []
        self.mask: list[list[int]] = []
        self.hashes: list[list[bytes]] = []

    def extend(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        ids = input_ids.tolist()
        bits = attention_mask[:, -input_ids.shape[1]:].tolist() if attention_mask is not None else [
            [1] * len(r) for r in ids]
        if not self.tokens:
            self.tokens, self.mask, self.hashes = [[] for _ in ids], [[] for _ in ids], [[] for _ in ids]
        for b, (row, row_bits) in enumerate(zip(ids, bits)):
            self.tokens[b] += row
            self.mask[b] += [int(x) for x in row_bits]
            parent = self.hashes[b][-1] if self.hashes[b] else self.root
            self.hashes[b] += page_hashes(self.tokens[b], self.mask[b], self.page_size, len(self.hashes[b]), parent)

    def remap(self, order: list[int]) -> None:
        self.tokens = [list(self.tokens[i]) for i in order]
        self.mask = [list(self.mask[i]) for i in order]
        self.hashes = [list(self.hashes[i]) for i in order]

    def truncate(self, num_tokens: int) -> None:
        if num_tokens == 0:
            self.clear()
            return
        for b in range(len(self.tokens)):
            del self.tokens[b][num_tokens:], self.mask[b][num_tokens:]
            del self.hashes[b][num_tokens // self.page_size:]

    def clear(self) -> None:
        self.tokens, self.mask, self.hashes = [], [], []


def _prefix_hook(module, args, kwargs):
    """Forward pre-hook: log tokens for a bound PagedCache; reuse cached prefix pages on an empty one."""
    from .cache import PagedCache

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(cache, PagedCache) or cache.token_log is None or input_ids is None:
        return None
    attention_mask = kwargs.get("attention_mask")
    cache.commit()  # hash the pages filled by the previous step before this one can free them
    cache.token_log.truncate(cache.get_seq_length())  # a forward that failed before any layer ran
    if cache.get_seq_length() == 0:
        cache.token_log.root = cache.fingerprint(module)
        reused = cache.reuse_prefix(input_ids, attention_mask)
        if reused:
            kwargs["input_ids"] = input_ids = input_ids[:, reused:]
            args = ()
            for name in ("position_ids", "cache_position"):
                value = kwargs.get(name)
                if torch.is_tensor(value) and value.shape[-1] > input_ids.shape[1]:
                    kwargs[name] = value[..., reused:]
    cache.token_log.extend(input_ids, attention_mask)
    return args, kwargs


def install_hook(model: torch.nn.Module) -> None:
    """Register the prefix hook on ``model`` once (it acts only on bound PagedCaches)."""
    if not getattr(model, _HOOKED, False):
        model.register_forward_pre_hook(_prefix_hook, with_kwargs=True)
        setattr(model, _HOOKED, True)
