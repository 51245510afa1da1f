"""A hypothesis state machine for continuous batching (issue 30): runs of `stream_many` on one `RaggedCache`
(admission, reservations, retirement, forked samples, duplicate prompts, shared prefixes across runs, early stop
tokens, tight pools), advanced a few tokens at a time and ended at any point: finished, closed (an interrupt
between steps), failed in a forward (after some layers wrote), or with the cache reset under it.

The model is a stand-in, `ChainModel`, whose every key is a rolling hash of its sequence's tokens so far, read back
through the cache (as attention reads the past), and whose logits are a fixed function of that hash: a missed copy
on write, a wrong page reused, a lost or misplaced write changes the tokens that follow. Every output must equal
the same chain computed alone (greedy, or sampled with the output's documented seed); after every step the
scheduler's invariants hold (`Scheduler.check_invariants`: ``reserved`` is the running rows' reserves, each covers
what its row may still allocate) and every running row's pages hold its chain; when no run is live, the cache
holds nothing and its pages are accounted for.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import transformers
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

import hf_paged
from batching_checks import checked_scheduling
from hf_paged.block_manager import EVICTED
from hf_paged.ragged_cache import RaggedCache
from test_ragged_faults import Interrupt

VOCAB, BASE, MODULUS = 12, 31, 1_000_003  # keys stay exact in float32 (below 2**24)
LAYOUTS = (("full_attention",) * 2, ("sliding_attention", "full_attention"), ("sliding_attention",) * 2)
FRAGMENTS = ([1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 0, 1, 2], [3], [4, 4, 4, 4])  # prompts share prefixes


def chain(h: int, token: int) -> int:
    return (h * BASE + token + 1) % MODULUS


def logits_of(h: int) -> torch.Tensor:
    """The next-token logits after hash ``h`` (float32, the same in the model and the reference)."""
    return torch.tensor([(h * (v + 3)) % 29 / 4.0 for v in range(VOCAB)], dtype=torch.float32)


class ChainModel(torch.nn.Module):
    """Layer l's key (and minus its value) of token i is h_i = chain(h_{i-1}, token_i), h_{-1} = ``salt``; h_{i-1}
    is read from the cache. ``fail_after_layer`` makes the next forward raise once that layer wrote."""

    def __init__(self, salt: int, layer_types: tuple[str, ...] = ("full_attention",) * 2, window: int = 4):
        super().__init__()
        self.config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=4, intermediate_size=4,
                                               num_hidden_layers=len(layer_types), num_attention_heads=1,
                                               num_key_value_heads=1, head_dim=2, max_position_embeddings=512)
        self.config.layer_types, self.config.sliding_window = list(layer_types), window  # (what the cache reads)
        self.config._attn_implementation = hf_paged.ATTN_IMPLEMENTATION
        self.generation_config = transformers.GenerationConfig()
        self.salt = torch.nn.Parameter(torch.tensor([float(salt)]), requires_grad=False)  # (the fingerprint's)
        self.fail_after_layer = None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, input_ids, position_ids, logits_to_keep, use_cache, **kwargs):
        cache = kwargs[hf_paged.CACHE_KWARG]
        step, S = cache.step, cache.page_size  # (the widest group's: it holds every token's previous one)
        widest = next(layer for layer in cache.layers if layer.group is cache.groups[0])
        copied_from = {} if step.copy_src is None else dict(zip(step.copy_dst.tolist(), step.copy_src.tolist()))
        tokens, hashes = input_ids[0].tolist(), []
        for segment in step.segments:
            h = int(self.salt)
            if segment.past:
                page = int(segment.pages[(segment.past - 1) // S])
                h = int(widest.pages.keys[copied_from.get(page, page), (segment.past - 1) % S, 0, 0])
            for token in tokens[segment.start:segment.start + segment.length]:
                h = chain(h, token)
                hashes.append(h)
        keys = torch.tensor(hashes, dtype=torch.float32)[None, None, :, None].expand(1, 1, -1, 2).contiguous()
        for index, layer in enumerate(cache.layers):
            layer.update(keys, -keys, index)
            if index == self.fail_after_layer:
                self.fail_after_layer = None
                raise RuntimeError("planted forward failure")
        kept = [logits_of(hashes[i]) for i in logits_to_keep.tolist()]
        logits = torch.stack(kept) if kept else torch.zeros(0, VOCAB)
        return transformers.modeling_outputs.CausalLMOutput(logits=logits[None])


def expected(salt: int, prompt: list[int], new: int, stop: set[int], seed: int | None) -> list[int]:
    """One output computed alone: the chain over the prompt, then greedy or sampled tokens with their own seed."""
    h = salt
    for token in prompt:
        h = chain(h, token)
    generator, out = None if seed is None else torch.Generator().manual_seed(seed), []
    for _ in range(new):
        logits = logits_of(h)
        token = int(logits.argmax()) if generator is None else int(
            torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        out.append(token)
        if token in stop:
            break
        h = chain(h, token)
    return out


def needed_pages(prompts, news, samples: int, page_size: int) -> int:
    """The most pages one prompt's rows may hold together (its samples and its repeats are admitted with it): the
    first request's pages, then each further row's own (the prompt's partial page copied, its new tokens)."""
    groups = {}
    for prompt, new in zip(prompts, news):
        last = -(-(len(prompt) + new) // page_size)
        own = last - len(prompt) // page_size
        first = tuple(prompt) not in groups
        groups[tuple(prompt)] = groups.get(tuple(prompt), 0) + (last + (samples - 1) * own if first else samples * own)
    return max(groups.values())


class BatchingMachine(RuleBasedStateMachine):
    schedulers: list = []  # every Scheduler made while the machine runs (`checked_scheduling`'s list)

    def __init__(self):
        super().__init__()
        self.run = None

    @initialize(page_size=st.integers(1, 4), max_pages=st.one_of(st.none(), st.integers(4, 24)),
                layer_types=st.sampled_from(LAYOUTS), window=st.integers(2, 6))  # (the model reads one token back)
    def start(self, page_size, max_pages, layer_types, window):
        self.models = [ChainModel(salt, layer_types, window) for salt in (7, 11)]
        self.cache = RaggedCache(self.models[0].config, page_size=page_size, max_pages=max_pages)

    # ------------------------------------------------------------------------ runs
    @precondition(lambda self: self.run is None)
    @rule(data=st.data())
    def start_run(self, data):
        draw = data.draw
        pieces = st.lists(st.sampled_from(range(len(FRAGMENTS))), min_size=1, max_size=3)
        prompts = [[t for i in draw(pieces, label="fragments") for t in FRAGMENTS[i]]
                   for _ in range(draw(st.integers(1, 4), label="prompts"))]
        if draw(st.booleans(), label="repeat the first prompt"):
            prompts.append(prompts[0])
        news = [draw(st.integers(1, 6), label="new") for _ in prompts]
        samples = draw(st.integers(1, 3), label="samples")
        sample = draw(st.booleans(), label="sample")
        stop = set(draw(st.lists(st.integers(0, VOCAB - 1), max_size=2), label="stop"))
        model = self.models[draw(st.integers(0, 1), label="model")]
        kwargs = dict(max_new_tokens=news, num_return_sequences=samples, eos_token_id=sorted(stop), cache=self.cache,
                      max_batch_tokens=draw(st.integers(1, 16), label="max_batch_tokens"), progress=False)
        if sample:
            kwargs.update(do_sample=True, seed=draw(st.integers(0, 1000), label="seed"))
        limit, made = self.cache.manager.max_pages, len(self.schedulers)
        fits = limit is None or needed_pages(prompts, news, samples, self.cache.page_size) <= limit
        try:
            stream = hf_paged.stream_many(model, prompts, **kwargs)
        except hf_paged.CacheUsageError as error:
            assert not fits and f"max_pages={limit}" in str(error), error  # refused only when it cannot fit
            return
        assert fits, "a run that cannot fit the pool was accepted"
        seeds = [kwargs["seed"] + k if sample else None for k in range(len(prompts) * samples)]
        want = [expected(int(model.salt), prompts[k // samples], news[k // samples], stop, seeds[k])
                for k in range(len(prompts) * samples)]
        self.run = dict(stream=stream, model=model, want=want, got=[[] for _ in want], started=False,
                        scheduler=self.schedulers[made] if len(self.schedulers) > made else None)

    def _next(self) -> bool:
        """One more token of the run (False: it ended, every output as computed alone)."""
        run = self.run
        try:
            index, token = next(run["stream"])
        except StopIteration:
            assert run["got"] == run["want"]
            self.run = None
            return False
        run["started"] = True
        run["got"][index].append(token)
        assert run["got"][index] == run["want"][index][:len(run["got"][index])], index
        return True

    @precondition(lambda self: self.run is not None)
    @rule(tokens=st.integers(1, 8))
    def advance(self, tokens):
        for _ in range(tokens):
            if not self._next():
                return

    @precondition(lambda self: self.run is not None)
    @rule()
    def finish(self):
        while self._next():
            pass

    @precondition(lambda self: self.run is not None)
    @rule()
    def interrupt(self):
        """The caller stops between steps (a break, an interrupt): closing the generator gives everything back."""
        self.run["stream"].close()
        self.run = None

    @precondition(lambda self: self.run is not None)
    @rule(layer=st.integers(0, 1))
    def fail_a_forward(self, layer):
        """The next forward raises after ``layer`` wrote (unless the run ends first)."""
        model = self.run["model"]
        model.fail_after_layer = layer
        try:
            while self._next():
                pass
        except RuntimeError as error:
            assert "planted forward failure" in str(error)
            self.run = None
        model.fail_after_layer = None

    @precondition(lambda self: self.run is not None)
    @rule(at=st.integers(1, 80))
    def interrupt_the_bookkeeping(self, at):
        """KeyboardInterrupt at the ``at``-th bookkeeping call from here (the cache's, the scheduler's, the block
        manager's; unless the run ends first): the run ends; whatever the interrupt left, the next run (or
        reset) finds a usable cache."""
        with Interrupt(at).patched():
            try:
                while self._next():
                    pass
            except KeyboardInterrupt:
                self.run = None

    @precondition(lambda self: self.run is not None)
    @rule()
    def reset_under_the_run(self):
        """reset() while the run is paused: a started run stops with an error; one not yet started runs normally."""
        self.cache.reset()
        if self.run["started"]:
            with pytest.raises(hf_paged.CacheUsageError, match="was reset"):
                next(self.run["stream"])
            self.run = None

    @precondition(lambda self: self.run is None)
    @rule()
    def reset(self):
        self.cache.reset()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def pages_are_accounted_for(self):
        if not hasattr(self, "cache"):
            return
        for group in self.cache.groups:  # (every group: the scheduler budgets the widest, the others follow it)
            manager = group.manager
            manager.check_invariants()
            if self.run is None and self.cache.user is None:
                assert self.cache.sequences == {} and manager.num_used == 0
            if manager.max_pages is not None:
                assert manager.num_used <= manager.max_pages
        if self.run is None and self.cache.user is not None:  # an interrupt in the run's clean-up: what it left
            assert not self.cache.user.live                    # goes at the next claim or reset

    @invariant()
    def running_rows_hold_their_chains(self):
        """Every running row's pages hold h_0 .. h_{computed - 1} of its tokens, in every layer; a sliding window's
        group holds at least the pages its window still reads."""
        run = getattr(self, "run", None)
        if run is None or run["scheduler"] is None or not self.cache.layers[0].is_initialized:
            return
        S = self.cache.page_size
        for row in run["scheduler"].running:
            seq = self.cache.sequences[row.out_index]
            h, want = int(run["model"].salt), []
            for token in row.tokens[:row.computed]:
                h = chain(h, token)
                want.append(h)
            for layer in self.cache.layers:
                table = seq.tables[self.cache.groups.index(layer.group)]
                first = next((i for i, page in enumerate(table) if page != EVICTED), len(table))
                assert EVICTED not in table[first:] and first <= layer.group.first_needed(row.computed)
                got = [int(layer.pages.keys[table[i // S], i % S, 0, 0]) for i in range(first * S, row.computed)]
                assert got == want[first * S:], (row.out_index, got, want)

    def teardown(self):
        if getattr(self, "run", None) is not None:
            self.run["stream"].close()


def checked_abort(cache: RaggedCache) -> None:
    """After `abort_step`: each page is referenced once by every sequence that holds it (the run's clean-up, which
    recounts every page, would hide a reference an abort failed to give back)."""
    for g, group in enumerate(cache.groups):
        held = Counter(p for seq in cache.sequences.values() for p in seq.tables[g] if p != EVICTED)
        ref = group.manager.ref
        live = {p: ref[p] for p in range(group.manager.num_pages) if ref[p]}
        assert live == dict(held), "abort_step lost a reference"


def test_continuous_batching_state_machine(monkeypatch):
    real_abort = RaggedCache.abort_step

    def abort_step(self):
        real_abort(self)
        checked_abort(self)

    monkeypatch.setattr(RaggedCache, "abort_step", abort_step)
    with checked_scheduling() as made:
        monkeypatch.setattr(BatchingMachine, "schedulers", made)
        run_state_machine_as_test(BatchingMachine, settings=settings(
            max_examples=100, stateful_step_count=30, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
