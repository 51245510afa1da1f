"""`PrefixHook`: the forward pre-hook that connects a bound `PagedCache` to its model.

A cache made with ``PagedCache(model=model)`` registers one hook on ``model`` and keeps its handle:
``cache.unbind()`` (or the cache being garbage collected) removes it again. The hook acts only on
forwards whose cache is its own. It logs their tokens, mask bits and positions (`TokenLog`, whose
page hashes make full pages reusable) and, when a forward starts on an empty cache, shares the
cached pages of the prompt's leading full pages and trims the inputs by that much. It never trims
a token whose logits the caller asked for: ``logits_to_keep`` (0, the default of a plain
``model(**inputs, cache=cache)``, asks for every token, so nothing is reused there; ``generate``
asks for the last one). ``cache.prefill(model, **inputs)`` is the explicit form.
"""

from __future__ import annotations

import functools
import weakref

import torch

from .prefix_cache import check_hashable


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
