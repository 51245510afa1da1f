"""Prefix caching: content hashes of full pages, and the model hook that reuses them.

A cache bound to a model (``PagedCache(model=model)``) sees every forward's ``input_ids``,
``attention_mask`` and ``position_ids`` through a forward pre-hook (`hf_paged.prefix_hook`). It logs them per row, so each
full page gets a chained content hash: ``h_i = sha256(h_{i-1} || tokens_i || positions_i || mask_i)``.
A page's K/V depend on everything before it (the chain), on its tokens' positions (RoPE,
learned position embeddings: left padding shifts them) and on the mask (what earlier tokens see).
The chain is rooted at ``h_{-1}``, a fingerprint of what computed the K/V
(`model_fingerprint`: model class, config, dtype, devices, sampled weights, page size, layer
windows), so pages never match across models. The hash is stable across processes. When a forward starts on an empty cache, the hook looks the
prompt's pages up, shares the longest page-aligned prefix found for every row of every layer
group, and trims the inputs so that only the new tokens are computed, never more than leaves the
logits the caller asked for (``logits_to_keep``): ``model.generate(**inputs, cache=cache)`` stays
one line. Prefix caching needs 2D padding masks (a custom 4D mask is refused).
"""

from __future__ import annotations

import hashlib

import torch


def page_hashes(tokens: list[int], mask: list[int], positions: list[int], page_size: int, start: int,
                parent: bytes) -> list[bytes]:
    """Chained hashes of the full pages of ``tokens`` from page ``start`` on (``parent``: the hash before)."""
    hashes = []
    for i in range(start, len(tokens) // page_size):
        sl = slice(i * page_size, (i + 1) * page_size)
        digest = hashlib.sha256(parent)
        digest.update(torch.tensor(tokens[sl], dtype=torch.int64).numpy().tobytes())
        digest.update(torch.tensor(positions[sl], dtype=torch.int64).numpy().tobytes())
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
def check_hashable(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> None:
    """Raise unless a step's mask and positions are ones that page hashes describe."""
    from .errors import CacheUsageError  # here: `page_hashes` stays importable without the package

    if attention_mask is not None and attention_mask.dim() != 2:
        raise CacheUsageError(
            f"prefix caching (PagedCache(model=...)) needs a 2D padding mask [batch, tokens]; got a "
            f"{attention_mask.dim()}D attention_mask, whose effect on the cached keys cannot be hashed. "
            "Use a PagedCache without model= for custom masks.")
    if position_ids is not None and position_ids.dim() > 2:
        raise CacheUsageError(
            f"prefix caching (PagedCache(model=...)) needs position_ids of shape [batch or 1, tokens], got "
            f"{tuple(position_ids.shape)}. Use a PagedCache without model= for this model.")


def step_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                past: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Per row: the step's tokens, mask bits (nonzero = attend, as transformers reads a 2D mask) and
    positions (``position_ids``, else ``past, past + 1, ...`` as the models default to)."""
    B, L = input_ids.shape
    bits = (attention_mask[:, -L:] != 0).int() if attention_mask is not None else torch.ones_like(input_ids)
    if position_ids is None:
        position_ids = torch.arange(past, past + L)
    positions = position_ids.reshape(-1, position_ids.shape[-1])[..., -L:].expand(B, L)
    return input_ids.tolist(), bits.tolist(), positions.tolist()


class TokenLog:
    """Per row: the tokens, mask bits and positions processed so far, and the hashes of its full pages.

    Invariant: ``len(hashes[b]) == len(tokens[b]) // page_size`` after `extend` (hashes of pages
    that are full), chained from ``root`` (the fingerprint of the model that computes the rows); the log
    describes the first ``num_tokens`` tokens of its cache. Once the cache holds tokens the log never saw (a
    forward its hook could not log: ``inputs_embeds``, another model), it stops (`stop`): later pages get no hash
    (their K/V follow tokens it cannot name) until the log is cleared.
    """

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = b""
        self.tokens: list[list[int]] = []
        self.mask: list[list[int]] = []
        self.positions: list[list[int]] = []
        self.hashes: list[list[bytes]] = []
        self.stopped = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens[0]) if self.tokens else 0

    def stop(self) -> None:
        """The cache holds tokens after ``num_tokens`` that the log did not see: log nothing more."""
        self.stopped = True

    def extend(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None) -> None:
        if self.stopped:
            return
        past = self.num_tokens
        ids, bits, positions = step_inputs(input_ids, attention_mask, position_ids, past)
        if not self.tokens:
            self.tokens, self.mask, self.positions, self.hashes = ([[] for _ in ids] for _ in range(4))
        for b, (row, row_bits, row_pos) in enumerate(zip(ids, bits, positions)):
            self.tokens[b] += row
            self.mask[b] += row_bits
            self.positions[b] += row_pos
            parent = self.hashes[b][-1] if self.hashes[b] else self.root
            self.hashes[b] += page_hashes(self.tokens[b], self.mask[b], self.positions[b], self.page_size,
                                          len(self.hashes[b]), parent)

    def prompt_pages(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None, logits_to_keep: int | torch.Tensor) -> tuple[list, int]:
        """Per row, the hashes of a prompt's full pages (chained from ``root``), and how many of them a
        forward may reuse: leaving at least one token, and every token whose logits ``logits_to_keep``
        asks for (the last N; 0 = all, so none; or a tensor of indices), to compute."""
        S, length = self.page_size, input_ids.shape[1]
        if torch.is_tensor(logits_to_keep):
            first_kept = int(logits_to_keep.min()) % length if logits_to_keep.numel() else length
        else:
            first_kept = length - logits_to_keep if 0 < logits_to_keep <= length else 0
        ids, bits, positions = step_inputs(input_ids, attention_mask, position_ids, 0)
        rows = [page_hashes(*row, S, 0, self.root) for row in zip(ids, bits, positions)]
        return rows, min(min(first_kept, length - 1) // S, *(len(r) for r in rows))

    def restart(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, keep: int) -> None:
        """The log holds only the first ``keep`` tokens of this prompt (the pages reused for it)."""
        length = input_ids.shape[1]
        self.clear()
        self.extend(input_ids[:, :keep], None if attention_mask is None else attention_mask[:, -length:][:, :keep],
                    None if position_ids is None else position_ids[..., -length:][..., :keep])

    def remap(self, order: list[int]) -> None:
        self.tokens = [list(self.tokens[i]) for i in order]
        self.mask = [list(self.mask[i]) for i in order]
        self.positions = [list(self.positions[i]) for i in order]
        self.hashes = [list(self.hashes[i]) for i in order]

    def truncate(self, num_tokens: int) -> None:
        if num_tokens == 0:
            self.clear()
            return
        for b in range(len(self.tokens)):
            del self.tokens[b][num_tokens:], self.mask[b][num_tokens:], self.positions[b][num_tokens:]
            del self.hashes[b][num_tokens // self.page_size:]

    def clear(self) -> None:
        self.tokens, self.mask, self.positions, self.hashes = [], [], [], []
        self.stopped = False
