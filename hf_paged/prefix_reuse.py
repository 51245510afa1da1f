"""Prefix reuse for a `PagedCache` bound to a model: the forward pre-hook, the log of what it saw, and the
cache's side of reuse.

A cache made with ``PagedCache(model=model)`` registers one hook on ``model`` (`PrefixHook`) and keeps its
handle: ``cache.unbind()`` (or the cache being garbage collected) removes it again. The hook acts only on
forwards whose cache is its own. It logs their tokens, mask bits and positions per row (`TokenLog`, whose
page hashes, `hf_paged.prefix_index.page_hashes`, make full pages reusable) and, when a forward starts on an
empty cache, shares the cached pages of the prompt's leading full pages (`PrefixReuse.reuse_prefix`, through
each layer group's `PrefixIndex`) and trims the inputs by that much. It never trims a token whose logits the
caller asked for: ``logits_to_keep`` (0, the default of a plain ``model(**inputs, cache=cache)``, asks for
every token, so nothing is reused there; ``generate`` asks for the last one). A forward the hook cannot log
(``inputs_embeds``, another model stepping the cache) stops the log: no page after it gets a hash until
``reset()``. ``cache.prefill(model, **inputs)`` is the explicit form. Prefix caching needs 2D padding masks
(a custom 4D mask is refused).
"""

from __future__ import annotations

import functools
import weakref

import torch

from .errors import CacheUsageError
from .model_config import CACHE_KWARG
from .prefix_index import model_fingerprint, page_hashes
from .prefix_store.tier import make_tier


def check_hashable(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> None:
    """Raise unless a step's mask and positions are ones that page hashes describe."""
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


class PrefixReuse:
    """The prefix-reuse part of `PagedCache` (``token_log``, ``prefix_hook``, ``store_tier``; see
    `PagedCache(model=...)`)."""

    def bind_model(self, model, prefix_store=None, store_spill: bool = True) -> None:
        """Prefix caching for ``model`` (None: none): a token log and a forward hook; and a prefix store under the
        pool (`hf_paged.prefix_store.tier.make_tier`), whose tier listens to the groups' indexes from each prompt on."""
        if prefix_store is not None and model is None:
            raise CacheUsageError("prefix_store= needs prefix caching: PagedCache(model=model, prefix_store=...).")
        self.token_log = None if model is None else TokenLog(self.page_size)
        self.prefix_hook = None if model is None else PrefixHook(self, model)
        self.store_tier = make_tier(prefix_store, store_spill)

    @property
    def prefix_store(self):
        """The prefix store this cache reads and writes (None without one): ``flush()`` waits for its writes."""
        return None if self.store_tier is None else self.store_tier.store

    def store_stats(self) -> dict:
        """The store tier's counters (``store_*``; none without a store)."""
        return {} if self.store_tier is None else self.store_tier.counters_snapshot()

    def fingerprint(self, model) -> bytes:
        """The root of this cache's page hashes when ``model`` computes its K/V (see `model_fingerprint`)."""
        windows = [layer.group.sliding_window for layer in self.layers]
        return model_fingerprint(model, self.page_size, windows, self.kv_format)

    def reuse_prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 0) -> int:
        """On an empty bound cache: share the longest cached, page-aligned prefix of every row.

        Returns the number of tokens reused: the same for every row, and small enough that the
        tokens left to compute cover ``logits_to_keep`` (the last N; 0 = all, so nothing is reused;
        or a tensor of indices), so a forward returns the logits it would return without reuse.
        The prefix hook trims the inputs by that much.
        """
        self.commit()
        if self.get_seq_length() > 0 or not self.groups:
            return 0
        rows, most = self.token_log.prompt_pages(input_ids, attention_mask, position_ids, logits_to_keep)
        pages = self.groups.restore_prefix(rows, most)
        if pages:
            self.token_log.restart(input_ids, attention_mask, position_ids, pages * self.page_size)
        return pages * self.page_size

    def unbind(self) -> None:
        """Stop prefix caching: the hook leaves the model, the token log goes; pages stay as they are."""
        if self.prefix_hook is not None:
            self.prefix_hook.remove()
        self.prefix_hook = self.token_log = None

    def prefill(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """Run ``model`` on a prompt with this bound cache, reusing its cached prefix pages explicitly:
        only the tokens after the reused pages are computed, and the output holds the logits of the
        last token (what ``generate`` asks for). Returns the model output."""
        if self.prefix_hook is None or self.prefix_hook.model() is not model:
            raise CacheUsageError("prefill() needs a cache bound to this model: PagedCache(model=model).")
        return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1,
                     **{CACHE_KWARG: self}, **kwargs)


class PrefixHook:
    """The hook of one bound cache on one model (held weakly both ways)."""

    def __init__(self, cache, model: torch.nn.Module):
        self.model = weakref.ref(model)
        self.handle = model.register_forward_pre_hook(functools.partial(_before_forward, weakref.ref(cache)),
                                                      with_kwargs=True)
        weakref.finalize(cache, self.handle.remove)

    def remove(self) -> None:
        self.handle.remove()


def _before_forward(cache_ref, module, args, kwargs):
    """Log this forward's tokens for the bound cache; on an empty cache, reuse its cached prefix pages."""
    cache = cache_ref()
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if cache is None or kwargs.get("cache", kwargs.get("past_key_values")) is not cache or input_ids is None:
        return None
    attention_mask, position_ids = kwargs.get("attention_mask"), kwargs.get("position_ids")
    check_hashable(attention_mask, position_ids)  # before any change
    tier = cache.store_tier  # a prefix store: it times prefills, to weigh loading pages against computing them
    if tier is not None:
        tier.forward_done()
    cache.commit()  # hash the pages filled by the previous step before this one can free them
    cache.token_log.truncate(cache.get_seq_length())  # a forward that failed before any layer ran
    if cache.token_log.num_tokens < cache.get_seq_length():
        cache.token_log.stop()  # a forward this hook did not see (inputs_embeds, another model) wrote the cache
    if cache.get_seq_length() == 0:
        cache.token_log.root = cache.fingerprint(module)
        if tier is not None:
            tier.attach_layers(cache.layers)  # (groups change with `bind_config`)
            tier.bind(cache.token_log.root, module)
        logits_to_keep = kwargs.get("logits_to_keep", 0)
        reused = cache.reuse_prefix(input_ids, attention_mask, position_ids, logits_to_keep)
        if reused:
            kwargs["input_ids"], args = input_ids[:, reused:], ()
            for name in ("position_ids", "cache_position"):
                value = kwargs.get(name)
                if torch.is_tensor(value) and value.shape[-1] == input_ids.shape[1]:
                    kwargs[name] = value[..., reused:]
            if torch.is_tensor(logits_to_keep):  # indices into the sequence: they shift with it
                kwargs["logits_to_keep"] = logits_to_keep - reused
            input_ids = input_ids[:, reused:]
            position_ids = None if position_ids is None else position_ids[..., reused:]
    cache.token_log.extend(input_ids, attention_mask, position_ids)
    if tier is not None:
        tier.forward_begins(input_ids.numel(), cache.page_size)
    return args, kwargs
