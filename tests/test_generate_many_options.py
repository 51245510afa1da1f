"""`generate_many` speaks transformers (issue 36, part 2): a GenerationConfig (the model's generation_config as
defaults), transformers' logits processors built by its own machinery and reading each output's own tokens, stop
strings, finish reasons, strings out with decode=True, tokenizer outputs in; greedy output equals per-prompt
`generate` with the same keywords."""

import warnings

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

import hf_paged
from batching_checks import sampled_alone
from hf_paged.stats import GenerationStats
from test_generate_many import generate_each, random_prompts
from tiny_models import COMMON, left_padded_batch, make_pair

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = (9, 14, 6, 11)


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama")


@pytest.fixture(scope="module")
def tokenizer():
    """One character a token for the tiny models' 96 ids: 0-2 special, then printable characters."""
    chars = [chr(c) for c in range(33, 33 + COMMON["vocab_size"] - 3)]
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", *chars])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


class NoImmediateRepeat(LogitsProcessor):
    """Bans each row's last token: right only when it reads that row's own tokens."""

    def __call__(self, input_ids, scores):
        return scores.scatter(1, input_ids[:, -1:], -float("inf"))


def plain(ref, prompts):
    return generate_each(ref, prompts, NEW, eos_token_id=None)


@pytest.mark.parametrize("kwargs", [
    dict(repetition_penalty=3.0),
    dict(no_repeat_ngram_size=1),
    dict(bad_words_ids="first tokens"),
    dict(logits_processor=LogitsProcessorList([NoImmediateRepeat()])),
    dict(generation_config=GenerationConfig(repetition_penalty=2.0, suppress_tokens=[5, 6, 7])),
], ids=["repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "logits_processor", "generation_config"])
def test_greedy_with_processors_equals_generate_per_prompt(llama, kwargs):
    ref, paged = llama
    prompts = random_prompts((5, 17, 9, 30), seed=21)
    unprocessed = plain(ref, prompts)
    if kwargs.get("bad_words_ids") == "first tokens":
        kwargs = dict(bad_words_ids=[[out[0]] for out in unprocessed] + [[unprocessed[1][2], unprocessed[1][3]]])
    want = generate_each(ref, prompts, NEW, eos_token_id=None, **kwargs)
    assert want != unprocessed  # the keyword changes the output: the comparison below can fail
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=list(NEW), eos_token_id=[], page_size=4,
                                 max_batch_tokens=12, progress=False, **kwargs)
    assert got == want


def test_min_new_tokens_holds_back_the_stop_token(llama):
    ref, paged = llama
    prompts = random_prompts((5, 17, 9, 30), seed=21)
    stop = plain(ref, prompts)[0][1]  # prompt 0 would stop at its second token
    want = generate_each(ref, prompts, NEW, eos_token_id=stop, min_new_tokens=4)
    assert len(want[0]) >= 4 and want != generate_each(ref, prompts, NEW, eos_token_id=stop)
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=list(NEW), eos_token_id=stop, min_new_tokens=4,
                                 progress=False)
    assert got == want


def test_the_models_generation_config_is_the_default():
    """model.generation_config's fields apply as they do in generate; keywords override them."""
    ref, paged = make_pair("llama")
    for model in (ref, paged):
        model.generation_config.repetition_penalty = 3.0
        model.generation_config.max_new_tokens = 7
    prompts = random_prompts((5, 17), seed=22)
    want = [ref.generate(torch.tensor([p]), eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert want != generate_each(ref, prompts, [7, 7], eos_token_id=None, repetition_penalty=1.0)
    assert hf_paged.generate_many(paged, prompts, eos_token_id=[], progress=False) == want
    assert hf_paged.generate_many(paged, prompts, eos_token_id=[], repetition_penalty=1.0, progress=False) == \
        generate_each(ref, prompts, [7, 7], eos_token_id=None, repetition_penalty=1.0)


def test_stop_strings_and_finish_reasons(llama, tokenizer):
    ref, paged = llama
    prompts = random_prompts((5, 17, 9, 30), seed=21)
    unstopped = plain(ref, prompts)
    stop_string = tokenizer.decode(unstopped[1][3:5])  # prompt 1 stops after its 5th token
    stop_token = unstopped[2][2]
    kwargs = dict(stop_strings=[stop_string], tokenizer=tokenizer, eos_token_id=stop_token)
    want = generate_each(ref, prompts, NEW, **kwargs)
    assert want[1] == unstopped[1][:5]
    out = hf_paged.generate_many(paged, prompts, max_new_tokens=list(NEW), return_dict_in_generate=True,
                                 progress=False, **kwargs)
    assert out.sequences == want
    expected = ["stop_token" if w[-1] == stop_token else "stop_string" if tokenizer.decode(w).endswith(stop_string)
                else "length" for w in want]
    assert out.finish_reasons == expected and {"stop_token", "stop_string", "length"} <= set(expected)
    assert [o.finish_reason for o in out.stats.outputs] == expected


def test_decode_returns_strings_and_tokenizer_outputs_are_prompts(llama, tokenizer):
    """decode=True returns the decoded new tokens; a padded 2-D batch (what tokenizer(..., return_tensors='pt')
    returns, or a tensor with attention_mask=) gives the prompts without their padding."""
    _, paged = llama
    batch = left_padded_batch((9, 5, 13))
    prompts = [row[mask != 0].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    want = hf_paged.generate_many(paged, prompts, max_new_tokens=6, eos_token_id=[], progress=False)
    assert hf_paged.generate_many(paged, transformers.BatchEncoding(batch), max_new_tokens=6, eos_token_id=[],
                                  progress=False) == want
    assert hf_paged.generate_many(paged, batch["input_ids"], attention_mask=batch["attention_mask"],
                                  max_new_tokens=6, eos_token_id=[], progress=False) == want
    texts = hf_paged.generate_many(paged, prompts, max_new_tokens=6, eos_token_id=[], tokenizer=tokenizer,
                                   decode=True, progress=False)
    assert texts == [tokenizer.decode(w, skip_special_tokens=True) for w in want]
    strings = [tokenizer.decode(p) for p in prompts]
    assert hf_paged.generate_many(paged, strings, tokenizer=tokenizer, max_new_tokens=6, eos_token_id=[],
                                  progress=False) == want


def test_sampling_with_processors_is_each_output_alone_with_its_seed(llama):
    """Processors (a repetition penalty, a user processor) and per-output seeds: every sample equals its prompt
    sampled alone with its documented seed, whatever was batched with it."""
    _, paged = llama
    prompts = random_prompts((9, 14, 5), seed=23)
    kwargs = dict(eos_token_id=[], do_sample=True, repetition_penalty=1.5, top_k=0,
                  logits_processor=LogitsProcessorList([NoImmediateRepeat()]))
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=[6, 4, 7], num_return_sequences=2, seed=5,
                                 max_batch_tokens=9, progress=False, **kwargs)
    assert got == sampled_alone(paged, prompts, [6, 4, 7], 2, 5, **{k: v for k, v in kwargs.items()
                                                                    if k != "do_sample"})
    assert all(a != b for out in got for a, b in zip(out, out[1:]))  # the user processor was applied


def test_stats_object_is_filled(llama):
    _, paged = llama
    stats = GenerationStats()
    hf_paged.generate_many(paged, random_prompts((5, 17), seed=24), max_new_tokens=[3, 4], eos_token_id=[],
                           stats=stats, progress=False)
    assert [o.new_tokens for o in stats.outputs] == [3, 4] and stats.generated_tokens == 7


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_beams=2), "greedy search and sampling, not beam_search"),
    (dict(max_time=3.0), "does not support max_time"),
    (dict(no_such_option=1), r"does not take \['no_such_option'\]"),
    (dict(stop_strings=["ab"]), "stop_strings needs the model's tokenizer"),
    (dict(decode=True), "decode=True needs tokenizer="),
    (dict(generation_config=dict(top_k=3)), "generation_config must be a transformers GenerationConfig"),
    (dict(max_new_tokens=None), "give max_new_tokens"),
    (dict(page_size=8, cache="own"), r"page_size=8 with cache= \(whose page_size is 16\)"),
    (dict(max_pages=64, cache="own"), r"max_pages=64 with cache= \(whose max_pages is None\)"),
    (dict(attention_mask=torch.ones(2, 3)), "attention_mask= goes with a 2-D tensor"),
])
def test_what_generate_many_cannot_do_is_refused(llama, kwargs, match):
    _, paged = llama
    if kwargs.get("cache") == "own":
        kwargs["cache"] = hf_paged.RaggedCache(paged.config)
    call = {"max_new_tokens": 3, "progress": False, **kwargs}
    with pytest.raises(hf_paged.CacheUsageError, match=match):
        hf_paged.generate_many(paged, [[5, 6, 7], [8, 9]], **call)


def test_the_pools_arguments_may_repeat_the_caches_own(llama):
    _, paged = llama
    cache = hf_paged.RaggedCache(paged.config, page_size=8, max_pages=64)
    assert hf_paged.generate_many(paged, [[5, 6, 7]], max_new_tokens=2, page_size=8, max_pages=64, cache=cache,
                                  eos_token_id=[], progress=False) == \
        hf_paged.generate_many(paged, [[5, 6, 7]], max_new_tokens=2, eos_token_id=[], progress=False)


@pytest.mark.parametrize("kwargs,flag", [(dict(temperature=0.5), "temperature"), (dict(top_p=1.5), "top_p")])
def test_sampling_flags_without_do_sample_warn_as_in_generate(llama, kwargs, flag):
    ref, paged = llama
    with pytest.warns(UserWarning, match=f"`do_sample` is not set to `True`. However, `{flag}`"):
        got = hf_paged.generate_many(paged, [[5, 6, 7]], max_new_tokens=4, eos_token_id=[], progress=False,
                                     **kwargs)
    assert got == generate_each(ref, [[5, 6, 7]], [4], eos_token_id=None)  # greedy, as generate does
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning when sampling
        hf_paged.generate_many(paged, [[5, 6, 7]], max_new_tokens=4, do_sample=True, temperature=0.5,
                               progress=False)
