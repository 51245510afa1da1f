"""`PrefixHook`: the forward pre-hook that connects a bound `PagedCache` to its model, and `PrefixCaching`,
the cache's side of prefix caching (reuse, explicit prefill, unbind).

A cache made with ``PagedCache(model=model)`` registers one hook on ``model`` and keeps its handle:
``cache.unbind()`` (or the cache being garbage collected) removes it again. The hook acts only on
forwards whose cache is its own. It logs their tokens, mask bits and positions (`TokenLog`, whose
page hashes make full pages reusable; a forward it cannot log, with ``inputs_embeds`` or by another
model, stops the log: no page after it gets a hash until ``reset()``) and, when a forward starts on an
empty cache, shares the cached pages of the prompt's leading full pages and trims the inputs by that
much. It never trims a token whose logits the caller asked for: ``logits_to_keep`` (0, the default
of a plain ``model(**inputs, cache=cache)``, asks for every token, so nothing is reused there;
``generate`` asks for the last one). ``cache.prefill(model, **inputs)`` is the explicit form.
"""

from __future__ import annotations

import functools
import weakref

import torch

from .errors import CacheUsageError
from .model_config import CACHE_KWARG
from .prefix_cache import check_hashable, model_fingerprint


class PrefixCaching:
    """The prefix-caching part of `PagedCache` (``token_log``, ``prefix_hook``; see `PagedCache(model=...)`)."""

    def fingerprint(self, model) -> bytes:
        """The root of this cache's page hashes when ``model`` computes its K/V (see `model_fingerprint`)."""
        windows = [layer.group.sliding_window for layer in self.layers]
        return model_fingerprint(model, self.page_size, windows)

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
    cache.commit()  # hash the pages filled by the previous step before this one can free them
    cache.token_log.truncate(cache.get_seq_length())  # a forward that failed before any layer ran
    if cache.token_log.num_tokens < cache.get_seq_length():
        cache.token_log.stop()  # a forward this hook did not see (inputs_embeds, another model) wrote the cache
    if cache.get_seq_length() == 0:
        cache.token_log.root = cache.fingerprint(module)
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
    return args, kwargs
