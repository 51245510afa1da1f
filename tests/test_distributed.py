"""hf_paged.distributed + examples/distributed_generate.py: data-parallel generation, and device_map placement.

The launch test starts 2 real CPU processes (gloo) with accelerate and a tiny random Llama saved
to tmp_path, and checks the output against a 1-process run (~20-40 s on 2 cores).
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import hf_paged  # noqa: E402
from hf_paged import assets  # noqa: E402
from hf_paged.distributed import deal, generate_distributed, make_state, share  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "distributed_generate.py"
CPU_CONFIG = ROOT / "integrations" / "accelerate" / "cpu_2proc.yaml"
LAUNCH_TIMEOUT = 240  # seconds per launched run; they take ~10-20 s on an idle 2-core machine


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine two OpenMP
    threads per process can make them ~50x slower (spinning threads waiting for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------- tiny model
def _tiny_tokenizer():
    """A byte-level BPE tokenizer (320 tokens) trained offline on a few Britannica paragraphs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(assets.britannica_text().split("\n\n")[:50], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>",
                                   padding_side="left")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama (GQA) + tokenizer saved with save_pretrained: loadable by path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = _tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- work split
def _split(items, rank, num_processes, apply_padding=False):
    """accelerate's own PartialState.split_between_processes, as rank ``rank`` of ``num_processes``."""
    from accelerate import PartialState

    fake = SimpleNamespace(num_processes=num_processes, process_index=rank)
    with PartialState.split_between_processes(fake, list(items), apply_padding=apply_padding) as chunk:
        return list(chunk)


@pytest.mark.parametrize("num_processes", [2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 8, 11])
def test_deal_gives_each_item_to_exactly_one_rank(n, num_processes):
    items = list(range(n))
    chunks = [_split(deal(items, num_processes), r, num_processes) for r in range(num_processes)]
    assert sorted(x for c in chunks for x in c) == items
    assert [len(c) for c in chunks] == [len(_split(items, r, num_processes)) for r in range(num_processes)]
    assert all(c == sorted(c) for c in chunks)  # each rank keeps the longest-first order
    assert deal(items, 1) == items


def test_deal_is_snake_order():
    chunks = [_split(deal(list(range(7)), 2), r, 2) for r in range(2)]
    assert chunks == [[0, 3, 4, 6], [1, 2, 5]]
    chunks = [_split(deal(list(range(8)), 3), r, 3) for r in range(3)]
    assert chunks == [[0, 5, 6], [1, 4, 7], [2, 3]]


def test_split_with_apply_padding_would_duplicate():
    """Why `generate_distributed` never pads: 7 items on 2 ranks -> rank 1 gets the last item twice; its `share`
    gives every item to exactly one rank, for any count of items and ranks."""
    from accelerate import PartialState

    items = list(range(7))
    padded = [_split(items, r, 2, apply_padding=True) for r in range(2)]
    assert padded[1] == [4, 5, 6, 6]
    for n in (0, 1, 5, 7, 8):
        for num_processes in (2, 3):
            ranks = [SimpleNamespace(num_processes=num_processes, process_index=r) for r in range(num_processes)]
            for rank in ranks:  # accelerate's own split, as each rank's state would run it
                rank.split_between_processes = PartialState.split_between_processes.__get__(rank)
            shares = [share(rank, list(range(n))) for rank in ranks]
            assert sorted(x for s in shares for x in s) == list(range(n)), (n, num_processes, shares)


# ------------------------------------------------------------------------- launched runs
def _run(cmd, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               CUDA_VISIBLE_DEVICES="", HF_PAGED_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _generate_args(model_dir, out):
    return ["--model", str(model_dir), "--num-prompts", "7", "--min-words", "3", "--max-words", "30",
            "--max-batch-tokens", "16", "--max-new-tokens", "6", "--page-size", "4", "--out", str(out)]


def test_two_cpu_processes_match_one_process(tiny_model_dir, tmp_path):
    out2, out1 = tmp_path / "two.jsonl", tmp_path / "one.jsonl"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG)]
    proc = _run([*launch, str(SCRIPT), *_generate_args(tiny_model_dir, out2)], tmp_path)
    _run([sys.executable, str(SCRIPT), *_generate_args(tiny_model_dir, out1), "--no-progress"], tmp_path)

    # two ranks really ran: a gloo group of 2, distinct processes, both with work
    summary = json.loads((tmp_path / "two.summary.json").read_text())
    assert summary["num_processes"] == 2
    assert summary["distributed_type"] == "MULTI_CPU" and summary["backend"] == "gloo"
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len({r["pid"] for r in ranks} | {os.getpid()}) == 3
    assert [r["prompts"] for r in ranks] == [4, 3]  # snake order over 7 prompts: ranks 0 1 1 0 0 1 0
    assert all(r["new_tokens"] > 0 and r["kv"]["peak_pages_used"] > 0 for r in ranks)
    assert summary["total"]["new_tokens"] == sum(r["new_tokens"] for r in ranks)
    assert "rank 1 (cpu" in proc.stdout
    one = json.loads((tmp_path / "one.summary.json").read_text())
    assert one["num_processes"] == 1 and one["distributed_type"] == "NO"

    # every prompt exactly once, in input order, the same prompts as asked for
    lines = [json.loads(line) for line in out2.read_text(encoding="utf-8").splitlines()]
    assert [r["index"] for r in lines] == list(range(7))
    assert [r["prompt"] for r in lines] == assets.britannica_prompts(7, 3, 30, seed=0)
    assert all(set(r) == {"index", "prompt", "completion", "tokens", "prompt_tokens"} for r in lines)
    assert all(0 < r["tokens"] <= 6 for r in lines)

    # greedy: byte-identical to the 1-process run
    assert out2.read_bytes() == out1.read_bytes()


def test_two_cpu_processes_sample_what_one_process_samples(tiny_model_dir, tmp_path):
    """Sampling: every prompt draws with its own generator seeded by its index in the whole prompt list (not in a
    rank's share), so two launched processes give the completions of one process."""
    out2 = tmp_path / "two.jsonl"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG)]
    sampled = ["--do-sample", "--temperature", "1.5", "--seed", "3"]
    _run([*launch, str(SCRIPT), *_generate_args(tiny_model_dir, out2), *sampled, "--no-progress"], tmp_path)
    assert json.loads((tmp_path / "two.summary.json").read_text())["num_processes"] == 2
    model, tokenizer = assets.load_model_and_tokenizer(str(tiny_model_dir), attn_implementation="hf_paged")
    prompts = assets.britannica_prompts(7, 3, 30, seed=3)
    one = generate_distributed(model, tokenizer, prompts, max_batch_tokens=16, max_new_tokens=6, page_size=4,
                               state=make_state(), progress=False, seed=3, do_sample=True, temperature=1.5)
    lines = [json.loads(line) for line in out2.read_text(encoding="utf-8").splitlines()]
    assert [r["prompt"] for r in lines] == prompts
    assert [r["completion"] for r in lines] == [r["completion"] for r in one.results]
    with pytest.raises(ValueError, match="num_return_sequences must be 1"):
        generate_distributed(model, tokenizer, prompts, state=make_state(), do_sample=True, num_return_sequences=2)


# ------------------------------------------------------------------------------- in process
def test_generate_distributed_single_process_and_empty(tiny_model_dir):
    model, tokenizer = assets.load_model_and_tokenizer(str(tiny_model_dir), attn_implementation="hf_paged")
    state = make_state()
    assert state.num_processes == 1
    prompts = assets.britannica_prompts(5, 3, 30, seed=1)
    got = generate_distributed(model, tokenizer, prompts, max_batch_tokens=8, max_new_tokens=5, page_size=4,
                               state=state, progress=False)
    assert [r["index"] for r in got.results] == list(range(5))
    # each prompt alone with a fresh DynamicCache: the same tokens (stopping at and including EOS)
    for i, prompt in enumerate(prompts):
        enc = tokenizer([prompt], return_tensors="pt")
        ref = model.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        ids = ref[0, enc["input_ids"].shape[1]:].tolist()
        assert got.results[i]["tokens"] == len(ids)
        assert got.results[i]["completion"] == tokenizer.decode(ids, skip_special_tokens=True)
    rank = got.summary["ranks"][0]
    assert rank["prompts"] == 5 and rank["kv"]["page_size"] == 4
    assert rank["kv"]["pool_bytes"] > 0 and rank["kv"]["peak_pages_used"] > 0

    empty = generate_distributed(model, tokenizer, [], state=state, progress=False)
    assert empty.results == [] and empty.summary["total"]["new_tokens"] == 0


def test_a_prefix_store_carries_prompts_from_one_run_to_the_next(tiny_model_dir, tmp_path):
    from hf_paged.distributed import format_summary
    model, tokenizer = assets.load_model_and_tokenizer(str(tiny_model_dir), attn_implementation="hf_paged")
    prompts = assets.britannica_prompts(3, 20, 40, seed=2)
    runs = [generate_distributed(model, tokenizer, prompts, max_new_tokens=4, page_size=4, state=make_state(),
                                 progress=False, prefix_store=str(tmp_path)) for _ in range(2)]
    assert runs[0].results == runs[1].results
    first, second = (run.summary["ranks"][0]["kv"] for run in runs)
    assert first["store_hits"] == 0 and first["store_pages_written"] > 0
    assert second["store_hits"] > 0 and second["store_misses"] == 0 and "store:" in format_summary(runs[1].summary)


# --------------------------------------------------------------------------------- device_map
def _check_pools_follow_layers(model, cache, dtype):
    decoder_layers = model.model.layers
    assert len(cache.layers) == len(decoder_layers)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for layer, block in zip(cache.layers, decoder_layers):
        weight = block.self_attn.k_proj.weight
        assert layer.device == weight.device and layer.dtype == weight.dtype == dtype
        for pool in (layer.pages.keys, layer.pages.values):
            assert pool.device == weight.device and pool.dtype == dtype
            assert pool.shape == (layer.group.manager.num_pages, cache.page_size, cfg.num_key_value_heads, head_dim)


def test_pools_follow_each_layers_keys_device_and_dtype():
    """What a device_map relies on: each layer's pools are made from its own first keys, so layer 0
    on one device/dtype and layer 1 on another get their own pools ("meta" stands in for a 2nd device)."""
    cache = hf_paged.PagedCache(page_size=4)
    placements = [("cpu", torch.bfloat16), ("meta", torch.float32)]
    for step_len, total in ((5, 5), (1, 6)):  # prefill, then one decode step
        for i, (device, dtype) in enumerate(placements):
            k = torch.randn(2, 2, step_len, 16, device=device, dtype=dtype)
            keys, values = cache.update(k, k.clone(), i)
            assert keys.shape == (2, 2, total, 16)
    assert cache.get_seq_length() == 6  # asked between steps, as a model does
    for layer, (device, dtype) in zip(cache.layers, placements):
        assert layer.device == torch.device(device) and layer.dtype == dtype
        for pool in (layer.pages.keys, layer.pages.values):
            assert pool.device == torch.device(device) and pool.dtype == dtype
            assert pool.shape[1:] == (4, 2, 16) and pool.shape[0] >= 4  # 2 rows x 2 pages of 4 tokens
        read_k, read_v = layer.read()
        assert read_k.device == torch.device(device) and read_k.shape == (2, 6, 2, 16)
    assert cache.stats()["tokens_stored"] == 12


def _device_map(model_dir, placement):
    """{module name: device} for a 2-layer Llama: embeddings, layer 0, layer 1, norm + lm_head."""
    first, second = placement
    return {"model.embed_tokens": first, "model.rotary_emb": first, "model.layers.0": first,
            "model.layers.1": second, "model.norm": second, "lm_head": second}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_device_map_pools_on_each_layers_device_and_dtype(tiny_model_dir, dtype):
    model, tokenizer = assets.load_model_and_tokenizer(
        str(tiny_model_dir), dtype=dtype, attn_implementation="hf_paged",
        device_map=_device_map(tiny_model_dir, ("cpu", "cpu")))
    cache = hf_paged.PagedCache(page_size=4, config=model.config)
    enc = tokenizer(["Shakespeare was born", "The plays"], return_tensors="pt", padding=True)
    model.generate(**enc, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    _check_pools_follow_layers(model, cache, dtype)
    # the data-parallel helper sends inputs to the first device of the map
    got = generate_distributed(model, tokenizer, ["Shakespeare was born", "The plays"],
                               max_new_tokens=4, state=make_state(), progress=False)
    assert [r["index"] for r in got.results] == [0, 1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (layer 0 on cuda:0, layer 1 on cuda:1)")
def test_device_map_across_two_gpus(tiny_model_dir):
    # (a GPU + "cpu" map would not do: accelerate then offloads the "cpu" layers, which run on the GPU)
    model, tokenizer = assets.load_model_and_tokenizer(
        str(tiny_model_dir), dtype=torch.float32, attn_implementation="hf_paged",
        device_map=_device_map(tiny_model_dir, (0, 1)))
    enc = tokenizer(["Shakespeare was born", "The plays"], return_tensors="pt", padding=True).to("cuda:0")
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    cache = hf_paged.PagedCache(page_size=4, config=model.config)
    out = model.generate(**enc, cache=cache, **gen)
    _check_pools_follow_layers(model, cache, torch.float32)
    assert [layer.pages.device for layer in cache.layers] == [torch.device("cuda:0"), torch.device("cuda:1")]
    assert torch.equal(out, model.generate(**enc, **gen))  # same placement, transformers' DynamicCache
