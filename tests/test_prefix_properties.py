"""A state machine over a cache bound to a model: generate (greedy, beams, samples, prompt lookup, an
assistant), continue, reset, fork, crop, reorder, with prompts that repeat earlier sequences, cut them, shift
them to other positions or put them after another prefix.

Oracle, after every generation: its tokens and every step's logits equal those of the same generation with
a fresh DynamicCache, and the pages reused (``stats()["prefix_hits"]``) never exceed the pages of the
longest prefix of the prompt that some earlier run computed with its whole context.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from transformers import DynamicCache

import hf_paged
from page_checks import check_pages
from tiny_models import make_config, make_pair

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 96
GREEDY = dict(pad_token_id=0, eos_token_id=None, do_sample=False)
_MODELS: dict = {}


def models():
    """(reference, bound model, assistant): built once (binding installs the prefix hook on the model)."""
    if not _MODELS:
        ref, paged = make_pair("llama")
        cfg = make_config("llama")
        cfg.num_hidden_layers = 1
        torch.manual_seed(1)
        _MODELS.update(ref=ref, paged=paged, assistant=transformers.AutoModelForCausalLM.from_config(cfg).eval())
    return _MODELS["ref"], _MODELS["paged"], _MODELS["assistant"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class PrefixMachine(RuleBasedStateMachine):
    """Caches (a root and its forks) bound to one model; per cache, the token rows it holds, or None when
    empty, or "opaque" after beam search (its rows are beams in an order only generate knows)."""

    @initialize(page_size=st.integers(1, 3))
    def start(self, page_size):
        self.ref, self.paged, self.assistant = models()
        self.S = page_size
        self.caches = {0: hf_paged.PagedCache(page_size=page_size, model=self.paged)}
        self.rows: dict[int, object] = {0: None}
        self.next_id = 1
        self.computed: list[list[int]] = []  # token sequences some run computed with their whole context

    # ------------------------------------------------------------------- prompts
    def _tokens(self, data, n: int) -> list[int]:
        seed = data.draw(st.integers(0, 2 ** 16), label="seed")
        return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    def _prompt_row(self, data) -> list[int]:
        kinds = ["fresh"] + (["repeat", "repeat", "another prefix", "shifted"] if self.computed else [])
        kind = data.draw(st.sampled_from(kinds), label="prompt")
        if kind == "fresh":
            return self._tokens(data, data.draw(st.integers(2, 9), label="length"))
        seq = data.draw(st.sampled_from(self.computed), label="earlier")
        if kind == "repeat":
            cut = data.draw(st.integers(1, len(seq)), label="cut")
            return seq[:cut] + self._tokens(data, data.draw(st.integers(1 if cut < 2 else 0, 3), label="extra"))
        if kind == "another prefix":
            return self._tokens(data, self.S) + seq[self.S:] + self._tokens(data, 1)
        return seq[data.draw(st.integers(1, self.S), label="shift"):] + self._tokens(data, 2)

    def _prompt(self, data) -> torch.Tensor:
        rows = [self._prompt_row(data) for _ in range(data.draw(st.integers(1, 2), label="rows"))]
        width = min(len(r) for r in rows)
        return torch.tensor([r[:width] for r in rows])

    # ------------------------------------------------------------------ the oracle
    def _generate(self, cid, input_ids, **gen):
        """Generate on cache ``cid`` and with a fresh DynamicCache: same tokens, same logits at every step."""
        ref, paged = self.ref, self.paged
        cache = self.caches[cid]
        gen = {**GREEDY, **gen, "output_logits": True, "return_dict_in_generate": True}
        mask = torch.ones_like(input_ids)
        seed = gen.pop("seed", 0)
        torch.manual_seed(seed)
        got = paged.generate(input_ids=input_ids, attention_mask=mask, cache=cache, **gen)
        torch.manual_seed(seed)
        want = ref.generate(input_ids=input_ids, attention_mask=mask, cache=DynamicCache(config=ref.config), **gen)
        assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
        for step, (g, w) in enumerate(zip(got.logits, want.logits)):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
        return got.sequences

    def _bound(self, input_ids: torch.Tensor, expand: int) -> int:
        """Most pages a prompt may reuse: every row's longest prefix computed before, short of its last token,
        for each of the ``expand`` rows generate makes of a prompt row (beams, returned sequences)."""
        rows = input_ids.tolist()
        tokens = min(max([common_prefix(r, s) for s in self.computed] + [0]) for r in rows)
        return len(rows) * expand * (min(tokens, input_ids.shape[1] - 1) // self.S)

    # ----------------------------------------------------------------------- rules
    @rule(data=st.data())
    def generate_on_an_empty_cache(self, data):
        """A new batch: on an empty cache (another one is reset first)."""
        empty = [i for i in sorted(self.caches) if self.rows[i] is None]
        cid = data.draw(st.sampled_from(empty or sorted(self.caches)), label="cache")
        if self.rows[cid] is not None:
            self.caches[cid].reset()
            self.rows[cid] = None
        prompt = self._prompt(data)
        speculative = ["lookup", "assistant"] if prompt.shape[0] == 1 else []  # transformers: one row only
        mode = data.draw(st.sampled_from(["greedy", "beams", "samples", *speculative]), label="mode")
        gen = dict(max_new_tokens=data.draw(st.integers(1, 5), label="new"))
        if mode == "beams":
            beams = data.draw(st.integers(2, 3), label="beams")
            gen.update(num_beams=beams, num_return_sequences=data.draw(st.integers(1, beams), label="returned"))
        elif mode == "samples":
            gen.update(do_sample=True, num_return_sequences=2, seed=data.draw(st.integers(0, 99), label="seed"))
        elif mode == "lookup":
            gen.update(prompt_lookup_num_tokens=2)
        elif mode == "assistant":
            gen.update(assistant_model=self.assistant)
        bound = self._bound(prompt, gen.get("num_beams", gen.get("num_return_sequences", 1)))
        before = self.caches[cid].stats()["prefix_hits"]
        out = self._generate(cid, prompt, **gen)
        hits = self.caches[cid].stats()["prefix_hits"] - before
        assert hits <= bound, (hits, bound, prompt.tolist())
        event("pages reused" if hits else "no page reused")  # pytest --hypothesis-show-statistics
        self._computed(cid, out, opaque=mode == "beams")

    def _computed(self, cid, out: torch.Tensor, opaque: bool = False) -> None:
        """Every returned sequence but its last token was computed (a beam's prefixes were running beams)."""
        held = out[:, :-1].tolist()
        self.computed += [r for r in held if r not in self.computed]
        self.rows[cid] = "opaque" if opaque or self.caches[cid].get_seq_length() != len(held[0]) else held

    def _holding(self) -> list[int]:
        return [i for i in sorted(self.caches) if isinstance(self.rows[i], list)]

    @precondition(lambda self: self._holding())
    @rule(data=st.data())
    def continue_generating(self, data):
        """A non-empty cache gets its rows plus new tokens (the multi-turn / prompt cache pattern)."""
        cid = data.draw(st.sampled_from(self._holding()), label="cache")
        rows = self.rows[cid]
        extra = torch.tensor([self._tokens(data, data.draw(st.integers(1, 3), label="extra"))] * len(rows))
        # greedy: a speculative generate on a non-empty cache misbehaves in transformers itself (DynamicCache too)
        gen = dict(max_new_tokens=data.draw(st.integers(1, 4), label="new"))
        out = self._generate(cid, torch.cat([torch.tensor(rows), extra], 1), **gen)
        self._computed(cid, out)

    @precondition(lambda self: len(self.caches) < 3)
    @rule(data=st.data())
    def fork(self, data):
        cid = data.draw(st.sampled_from(sorted(self.caches)), label="cache")
        self.caches[self.next_id] = self.caches[cid].fork()
        self.rows[self.next_id] = self.rows[cid] if not isinstance(self.rows[cid], list) else \
            [list(r) for r in self.rows[cid]]
        self.next_id += 1

    @precondition(lambda self: len(self.caches) > 1)
    @rule(data=st.data())
    def drop(self, data):
        cid = data.draw(st.sampled_from(sorted(self.caches)), label="cache")
        del self.caches[cid], self.rows[cid]

    @rule(data=st.data())
    def reset(self, data):
        cid = data.draw(st.sampled_from(sorted(self.caches)), label="cache")
        self.caches[cid].reset()
        self.rows[cid] = None

    @precondition(lambda self: self._holding())
    @rule(data=st.data())
    def crop(self, data):
        cid = data.draw(st.sampled_from(self._holding()), label="cache")
        n = data.draw(st.integers(0, len(self.rows[cid][0]) - 1), label="crop")
        self.caches[cid].crop(-n)
        self.rows[cid] = [r[:len(r) - n] for r in self.rows[cid]]

    @precondition(lambda self: self._holding())
    @rule(data=st.data())
    def reorder(self, data):
        cid = data.draw(st.sampled_from(self._holding()), label="cache")
        B = len(self.rows[cid])
        order = data.draw(st.lists(st.integers(0, B - 1), min_size=B, max_size=B), label="beam_idx")
        self.caches[cid].reorder_cache(torch.tensor(order))
        self.rows[cid] = [list(self.rows[cid][i]) for i in order]

    @invariant()
    def pages_are_accounted_for(self):
        if hasattr(self, "caches"):
            check_pages(*self.caches.values())


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=50, stateful_step_count=15, deadline=None, derandomize=True,
                                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
