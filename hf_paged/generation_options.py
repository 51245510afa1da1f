"""What `generate_many` takes and returns of transformers' generation interface.

Arguments are merged as `generate` merges them (transformers' own ``_prepare_generation_config``): the model's
``generation_config`` as defaults, then ``generation_config=``, then keywords; transformers' ``validate`` checks the
result (sampling flags without ``do_sample`` warn, as they do for `generate`). The logits processors are those
`generate` builds (``GenerationMixin._get_logits_processor``; a stand-in model with a ``config``, a
``generation_config`` and a ``device`` will do, a ``logits_processor=`` list merged in), one list per
(prompt length, max_new_tokens), since ``min_new_tokens``, ``forced_eos_token_id`` and the like count from a
prompt's own length. A processor always reads one output's own tokens (its prompt, then what it generated), never
a packed step. An output stops at a stop token, at a stop string (transformers' `StopStringCriteria`, which needs
``tokenizer=``), or at its ``max_new_tokens``: its finish reason.
"""

from __future__ import annotations

import copy
import math
import numbers
import operator
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import StopStringCriteria

from .errors import CacheUsageError
from .stats import GenerationStats

STOP_TOKEN, STOP_STRING, LENGTH = "stop_token", "stop_string", "length"  # finish reasons
MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
# GenerationConfig fields generate_many cannot honour (beside the modes): refused when set
UNSUPPORTED = dict(max_time="max_time", guidance_scale="classifier-free guidance", output_scores="output_scores",
                   output_logits="output_logits", output_attentions="output_attentions",
                   output_hidden_states="output_hidden_states")


def as_int(name: str, value) -> int:
    """``value`` as an int when it is one (a Python or NumPy integer, an integer tensor of one element)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise CacheUsageError(f"{name} must be an int, got {value!r} ({type(value).__name__}).") from None


def int_or_ints(name: str, value) -> int | list[int]:
    """An int (Python, NumPy, an integer tensor of one element), or a list of them, from ``value``; never a
    truncated float."""
    try:
        return as_int(name, value)
    except CacheUsageError:
        if not isinstance(value, (Sequence, torch.Tensor, np.ndarray)) or isinstance(value, str) or (
                getattr(value, "ndim", 1) == 0):
            raise CacheUsageError(f"{name} must be an int or a list of ints, got {value!r} "
                                  f"({type(value).__name__}).") from None
        return [as_int(f"each of {name}", v) for v in value]


def per_prompt(name: str, value, count: int) -> list[int]:
    """One int for every prompt, or one each."""
    values = int_or_ints(name, value)
    values = [values] * count if isinstance(values, int) else values
    if len(values) != count:
        raise CacheUsageError(f"{name} has {len(values)} entries for {count} prompts: give one int or one per prompt.")
    return values


def token_lists(prompts, tokenizer, attention_mask=None) -> list[list[int]]:
    """The prompts as token-id lists: a list of token-id lists, strings (with ``tokenizer``) or 1-D tensors; a 2-D
    tensor (one prompt a row); or what ``tokenizer(..., return_tensors="pt")`` returns (``input_ids`` and
    ``attention_mask``). Positions an attention mask zeroes (padding, left or right) are dropped."""
    if isinstance(prompts, Mapping):
        if "input_ids" not in prompts:
            raise CacheUsageError("prompts is a mapping without 'input_ids': pass what tokenizer(...) returns, or a "
                                  "list of token-id lists.")
        if attention_mask is not None:
            raise CacheUsageError("attention_mask is given twice: in prompts and as attention_mask=.")
        prompts, attention_mask = prompts["input_ids"], prompts.get("attention_mask")
    if isinstance(prompts, torch.Tensor) and prompts.ndim == 2:
        if attention_mask is not None:
            mask = torch.as_tensor(attention_mask)
            if mask.shape != prompts.shape:
                raise CacheUsageError(f"attention_mask has shape {tuple(mask.shape)}, input_ids "
                                      f"{tuple(prompts.shape)}: they must match.")
            prompts = [row[keep != 0] for row, keep in zip(prompts, mask)]
        else:
            prompts = list(prompts)
    elif attention_mask is not None:
        raise CacheUsageError("attention_mask= goes with a 2-D tensor of input_ids; lists of prompts need no padding.")
    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise CacheUsageError("prompts must be a list of token-id lists (or of strings, with tokenizer=), a 2-D "
                              "tensor, or what tokenizer(..., return_tensors='pt') returns.")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise CacheUsageError(f"prompt {i} is a string: pass tokenizer= to tokenize it.")
            prompt = tokenizer(prompt)["input_ids"]
        if isinstance(prompt, torch.Tensor):
            if prompt.is_floating_point() or prompt.is_complex():
                raise CacheUsageError(f"prompt {i} is a {prompt.dtype} tensor: token ids are ints (use .long()).")
            prompt = prompt.reshape(-1).tolist()
        out.append([as_int(f"prompt {i}'s token ids", t) for t in prompt])
    return out


def _check_sampling(config: GenerationConfig) -> None:
    """Sampling values of the types and ranges the warpers take (else a clear error, before any work)."""
    if not isinstance(config.do_sample, bool):
        raise CacheUsageError(f"do_sample must be True or False, got {config.do_sample!r}.")
    if as_int("num_return_sequences", config.num_return_sequences) < 1:
        raise CacheUsageError(f"num_return_sequences must be a positive int, got {config.num_return_sequences!r}.")
    if not config.do_sample:
        return
    temperature, top_k, top_p = config.temperature, config.top_k, config.top_p
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 < temperature < math.inf:
        raise CacheUsageError(f"temperature must be a positive number, got {temperature!r}.")
    if top_k is not None and as_int("top_k", top_k) < 0:
        raise CacheUsageError(f"top_k must be None, 0 (off) or a positive int, got {top_k!r}.")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise CacheUsageError(f"top_p must be None or a number in (0, 1], got {top_p!r}.")


def _validate(config: GenerationConfig, user_set: set[str]) -> None:
    """transformers' checks: what `generate` refuses raises `CacheUsageError`; what it warns about (a sampling flag
    the caller set without ``do_sample``, top_p=1.5 in greedy search) warns. Several returned sequences are checked
    separately (greedy ones are allowed here: copies that share their pages)."""
    single = copy.deepcopy(config)
    single.num_return_sequences = 1
    try:
        single.validate(user_set_attributes=user_set)
    except ValueError as error:
        raise CacheUsageError(f"generate_many: {error}") from None
    try:
        single.validate(strict=True, user_set_attributes=user_set)
    except ValueError as minor:
        warnings.warn(f"generate_many: {minor}", UserWarning, stacklevel=4)


class _GenerationView(GenerationMixin):
    """A model that is not a `GenerationMixin` (a stand-in with ``config``, ``generation_config`` and ``device``) as
    transformers' generation helpers see it."""

    def __init__(self, model):
        self.config, self.generation_config, self._device = model.config, model.generation_config, model.device

    @property
    def device(self):
        return self._device


class GenerationOptions:
    """The merged `GenerationConfig` of one run and what follows from it.

    Invariants: ``config`` is a private copy (``_eos_token_tensor`` set, ``eos_token_id`` None when no stop
    token); ``stop_tokens`` are its stop tokens; `processors` returns the same list for the same
    (prompt length, max_new_tokens); `needs_scores` is False only when every output takes the raw argmax.
    """

    def __init__(self, model, generation_config: GenerationConfig | None, keywords: dict,
                 logits_processor: LogitsProcessorList | None = None, tokenizer=None):
        if generation_config is not None and not isinstance(generation_config, GenerationConfig):
            raise CacheUsageError(f"generation_config must be a transformers GenerationConfig, got "
                                  f"{type(generation_config).__name__}.")
        if logits_processor is not None and not isinstance(logits_processor, (LogitsProcessorList, list)):
            raise CacheUsageError(f"logits_processor must be a LogitsProcessorList, got "
                                  f"{type(logits_processor).__name__}.")
        keywords = {k: v for k, v in keywords.items() if v is not None}
        model = model if isinstance(model, GenerationMixin) else _GenerationView(model)
        if "eos_token_id" in keywords:
            keywords["eos_token_id"] = int_or_ints("eos_token_id", keywords["eos_token_id"])
        samples = keywords.pop("num_return_sequences", None)  # set after the merge: transformers refuses greedy
        try:                                                   # copies, which share their pages here
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its own warnings come again from _validate, as ours
                config, unknown = model._prepare_generation_config(generation_config, **keywords)
        except ValueError as error:
            raise CacheUsageError(f"generate_many: {error}") from None
        if unknown:
            raise CacheUsageError(f"generate_many does not take {sorted(unknown)}: it takes the GenerationConfig "
                                  "fields as keywords, and its own (see its docstring).")
        if samples is not None:
            config.num_return_sequences = samples
        _check_sampling(config)
        mode = config.get_generation_mode()
        if mode not in MODES:
            raise CacheUsageError(f"generate_many does greedy search and sampling, not {mode.value} (num_beams, "
                                  "penalty_alpha, prompt lookup, constraints): use model.generate with a PagedCache.")
        for field, what in UNSUPPORTED.items():
            if getattr(config, field, None) not in (None, False, 1, 1.0):
                raise CacheUsageError(f"generate_many does not support {what} ({field}={getattr(config, field)!r}).")
        user_set = set(keywords) | set(generation_config.to_diff_dict() if generation_config else ())
        _validate(config, user_set)
        if config.eos_token_id is not None:
            stop = int_or_ints("eos_token_id", config.eos_token_id)
            config.eos_token_id = ([stop] if isinstance(stop, int) else stop) or None
        self.stop_tokens = frozenset(config.eos_token_id or ())
        model._prepare_special_tokens(config, device="cpu")
        self.model, self.config, self.user_processors = model, config, logits_processor
        self.num_return_sequences = int(config.num_return_sequences)
        self.do_sample = config.do_sample
        self.stop_strings = None
        if config.stop_strings is not None:
            if tokenizer is None:
                raise CacheUsageError("stop_strings needs the model's tokenizer: pass tokenizer= to generate_many.")
            self.stop_strings = StopStringCriteria(tokenizer, config.stop_strings)
        self._processors: dict[tuple[int, int], LogitsProcessorList] = {}

    def processors(self, prompt_length: int, max_new_tokens: int) -> LogitsProcessorList:
        """The processors (and warpers, when sampling) `generate` would apply to this prompt, built once."""
        key = (prompt_length, max_new_tokens)
        if key not in self._processors:
            self.config.max_length = prompt_length + max_new_tokens  # what generate sets from max_new_tokens
            self._processors[key] = self.model._get_logits_processor(
                self.config, input_ids_seq_length=prompt_length, logits_processor=self.user_processors, device="cpu")
        return self._processors[key]

    def needs_scores(self, requests) -> bool:
        """Whether any output needs its logits processed (else the argmax of the raw logits is its token)."""
        return self.do_sample or any(len(self.processors(len(r.prompt), r.max_new_tokens)) for r in requests)

    def next_token(self, logits: torch.Tensor, tokens: list[int], prompt_length: int, max_new_tokens: int,
                   generator: torch.Generator | None) -> int:
        """The next token of an output whose tokens so far are ``tokens``: its float32 CPU ``logits`` processed,
        then the argmax (greedy) or a draw from ``generator`` (sampling)."""
        scores = self.processors(prompt_length, max_new_tokens)(torch.tensor([tokens]), logits[None].clone())[0]
        if generator is None:
            return int(scores.argmax())
        return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))

    def finish_reason(self, tokens: list[int], generated: int, max_new_tokens: int) -> str | None:
        """Why an output whose last token was just generated stops now, or None: a stop token, a stop string, or
        its ``max_new_tokens``."""
        if tokens[-1] in self.stop_tokens:
            return STOP_TOKEN
        if self.stop_strings is not None and bool(self.stop_strings(torch.tensor([tokens]), None)[0]):
            return STOP_STRING
        return LENGTH if generated >= max_new_tokens else None


@dataclass
class ManyOutput:
    """What ``generate_many(..., return_dict_in_generate=True)`` returns; lists in output order (output
    ``i * num_return_sequences + j`` is sample ``j`` of prompt ``i``)."""

    sequences: list[list[int]]  # the new tokens of every output
    finish_reasons: list[str]  # "stop_token", "stop_string" or "length"
    stats: GenerationStats  # the run's figures
    texts: list[str] | None = None  # decoded new tokens (with decode=True)
