"""Regression tests for issue 11: no foreign code, no crash, no silently wrong tokens.

Crash-prone cases (loading a library, kernels on bad indices) run in a subprocess that must exit
normally: a negative return code is a signal (SIGSEGV, SIGBUS).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; it must end normally (no signal, exit status 0)."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert result.returncode >= 0, f"killed by signal {-result.returncode}:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# ----------------------------------------------------------------- 1, 2: the kernel library cache
LOAD_KERNEL = textwrap.dedent("""
    import warnings
    warnings.simplefilter("always")
    from hf_paged.kernels import cpu_paged_attention as k
    print("REASON", k.unavailable_reason())
""")

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("HF_PAGED_TEST_MARK"), "w");
    if (f) fclose(f);
}
int paged_attention_f32(void *a) { return 0; }
int paged_attention_bf16(void *a) { return 0; }
"""


@pytest.fixture(scope="module")
def built_kernel(tmp_path_factory) -> Path:
    """A kernel library built the normal way into a fresh cache folder (with its checksum record)."""
    home = tmp_path_factory.mktemp("built")
    run_python(LOAD_KERNEL, HF_PAGED_CACHE_DIR=str(home))
    (library,) = (home / "kernels").glob("cpu_paged_attention-*.so")
    return library


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory) -> Path:
    """A library with the kernel's symbols whose constructor touches $HF_PAGED_TEST_MARK when loaded."""
    folder = tmp_path_factory.mktemp("planted")
    source = folder / "planted.c"
    source.write_text(PLANTED_C)
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(folder / "planted.so"), str(source)],
                   check=True)
    return folder / "planted.so"


def _plant(home: Path, built_kernel: Path, library: Path, folder_mode: int = 0o700) -> Path:
    kernels = home / "kernels"
    kernels.mkdir(parents=True)
    os.chmod(kernels, folder_mode)
    target = kernels / built_kernel.name
    shutil.copy(library, target)
    return target


@needs_cc
@pytest.mark.parametrize("folder_mode", [0o777, 0o770])
def test_planted_library_in_a_shared_folder_is_never_loaded(tmp_path, built_kernel, planted_library, folder_mode):
    _plant(tmp_path / "cache", built_kernel, planted_library, folder_mode)
    mark = tmp_path / "loaded"
    out = run_python(LOAD_KERNEL, HF_PAGED_CACHE_DIR=str(tmp_path / "cache"), HF_PAGED_TEST_MARK=str(mark))
    assert not mark.exists(), "the planted library was loaded"
    assert "REASON None" in out.stdout  # the kernel was built into a private folder instead
    assert out.stderr.count("writable by other users") == 1 and "private folder" in out.stderr


@needs_cc
@pytest.mark.parametrize("tamper", ["no record", "forged record", "group-writable file", "foreign owner"])
def test_planted_library_in_a_private_folder_is_rebuilt(tmp_path, built_kernel, planted_library, tamper):
    target = _plant(tmp_path / "cache", built_kernel, planted_library)
    if tamper == "forged record":  # the genuine library's record next to a different file
        shutil.copy(built_kernel.with_name(built_kernel.name + ".sha256"), target.with_name(target.name + ".sha256"))
    elif tamper == "group-writable file":
        os.chmod(target, 0o775)
    elif tamper == "foreign owner":
        if os.getuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(target, 65534, 65534)
    mark = tmp_path / "loaded"
    out = run_python(LOAD_KERNEL, HF_PAGED_CACHE_DIR=str(tmp_path / "cache"), HF_PAGED_TEST_MARK=str(mark))
    assert not mark.exists(), "the planted library was loaded"
    assert "REASON None" in out.stdout and "rebuilding the CPU kernel" in out.stderr
    assert target.stat().st_uid == os.getuid() and target.read_bytes() != planted_library.read_bytes()


@needs_cc
def test_cache_folders_are_private(tmp_path, built_kernel):
    run_python(LOAD_KERNEL, HF_PAGED_CACHE_DIR=str(tmp_path / "new" / "cache"))
    assert (tmp_path / "new" / "cache" / "kernels").stat().st_mode & 0o777 == 0o700
    assert built_kernel.parent.stat().st_mode & 0o777 == 0o700


@needs_cc
@pytest.mark.parametrize("damage", ["truncated", "zero bytes", "not ELF"])
def test_damaged_library_is_rebuilt_without_a_crash(tmp_path, built_kernel, damage):
    target = _plant(tmp_path / "cache", built_kernel, built_kernel)
    shutil.copy(built_kernel.with_name(built_kernel.name + ".sha256"), target.with_name(target.name + ".sha256"))
    data = built_kernel.read_bytes()
    target.write_bytes({"truncated": data[: len(data) // 3], "zero bytes": b"", "not ELF": b"MZ" + data[2:]}[damage])
    out = run_python(LOAD_KERNEL + "import torch; from hf_paged.backends import resolve_backend\n"
                     "assert resolve_backend('auto', torch.device('cpu')) == 'cpu'\n",
                     HF_PAGED_CACHE_DIR=str(tmp_path / "cache"))
    assert "REASON None" in out.stdout and "rebuilding the CPU kernel" in out.stderr
    assert target.read_bytes() == data


@needs_cc
def test_library_without_the_kernel_symbols_falls_back_with_a_message(tmp_path, built_kernel):
    """A verified library that lacks the symbols: a reason, the torch path, no AttributeError."""
    code = """
        import os, subprocess, tempfile, warnings
        from pathlib import Path
        import torch
        from hf_paged.kernels import library_cache
        from hf_paged.backends import resolve_backend
        from hf_paged.kernels import cpu_paged_attention as k
        target = Path(os.environ["TARGET"])
        target.parent.mkdir(mode=0o700, parents=True)
        src = target.parent / "empty.c"
        src.write_text("int unrelated(void) { return 0; }\\n")
        built = target.parent / "empty.so"
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built), str(src)], check=True)
        library_cache.publish(built, target)
        reason = k.unavailable_reason()
        assert reason and "lacks the symbols" in reason, reason
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert resolve_backend("auto", torch.device("cpu")) == "torch"
        assert any("lacks the symbols" in str(w.message) for w in caught)
    """
    run_python(code, HF_PAGED_CACHE_DIR=str(tmp_path / "cache"),
               TARGET=str(tmp_path / "cache" / "kernels" / built_kernel.name))


# ------------------------------------------------------------------- 3: the kernels' page tables
BAD_INDEX = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, "tests")
    from kernel_cases import make_case
    from hf_paged.kernels import {module} as kernel
    case = make_case(B=2, Hq=4, Hkv=2, D=16, S=4, Q=1, lengths=[9, 6], pad=[1, 0], sink=True)
    P = case["k_pool"].shape[0]

    def table_with(value, dtype=torch.int64):
        table = case["page_table"].to(dtype).clone()
        table[0, 0] = value
        return table

    bad = {{
        "page id = num_pages": dict(page_table=table_with(P)),
        "page id 10**12": dict(page_table=table_with(10**12)),
        "page id -2": dict(page_table=table_with(-2)),
        "page id -2**62": dict(page_table=table_with(-2**62)),
        "NaN page id": dict(page_table=table_with(float("nan"), torch.float32)),
        "float positions": dict(page_pos=case["page_pos"].float()),
        "empty pools": dict(k_pool=case["k_pool"][:0], v_pool=case["v_pool"][:0]),
        "mask on meta": dict(mask=case["mask"].to("meta")),
        "s_aux on meta": dict(s_aux=case["s_aux"].to("meta")),
    }}
    names = {{"page id": "page_table", "NaN": "page_table", "float": "page_pos", "empty": "page_table",
              "mask": "mask", "s_aux": "s_aux"}}
    for label, change in bad.items():
        try:
            kernel.{function}(**{{**case, **change}})
        except ValueError as error:
            name = next(v for k, v in names.items() if label.startswith(k))
            assert name in str(error), (label, str(error))
            print("OK", label, "->", error)
        else:
            raise AssertionError(f"{{label}}: accepted")
""")


@needs_cc
def test_cpu_kernel_rejects_bad_indices_without_a_crash():
    out = run_python(BAD_INDEX.format(module="cpu_paged_attention", function="paged_attention_cpu"))
    assert out.stdout.count("OK ") == 9


def test_triton_kernel_rejects_bad_indices():
    pytest.importorskip("triton")
    out = run_python(BAD_INDEX.format(module="triton_paged_attention", function="paged_attention_triton"),
                     TRITON_INTERPRET="1")
    assert out.stdout.count("OK ") == 9


def test_page_ids_are_checked_once_per_step_not_per_layer(monkeypatch):
    """The reduction over the page table runs at most once per decode step and group, whatever the layer count
    (a step that reads the last step's table is not checked again)."""
    import torch

    import hf_paged
    from hf_paged.kernels import arguments
    from tiny_models import left_padded_batch, make_pair

    calls = []
    real = arguments.check_index
    monkeypatch.setattr(arguments, "check_index", lambda *a: calls.append(1) or real(*a))
    _, model = make_pair("llama")
    cache = hf_paged.PagedCache(page_size=4, config=model.config, backend="cpu")
    new_tokens = 5
    model.generate(**left_padded_batch(), max_new_tokens=new_tokens, do_sample=False,
                   **{hf_paged.CACHE_KWARG: cache})
    assert model.config.num_hidden_layers == 3 and 1 <= len(calls) <= new_tokens - 1  # decode steps, one group
    assert torch.is_tensor(cache.layers[0].pages.keys)


# ----------------------------------------------------------------------- 5: a failed step
class Boom(RuntimeError):
    pass


def _decode(model, cache, batch, steps, fail_at=None, fail_in=None):
    """Manual decode loop (prompt, then ``steps`` greedy tokens); step ``fail_at`` first fails once in
    ``fail_in(model, cache)`` (a context manager), and the test checks the cache reports the state before it."""
    import torch

    import hf_paged

    def state():
        stats = cache.stats()
        return (cache.get_seq_length(), [cache.get_mask_sizes(1, i) for i in range(len(cache.layers))],
                stats["tokens_stored"], stats["pages_used"], stats["evictions"], stats["page_size"])

    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = []
    for step in range(steps + 1):
        if step == fail_at:
            before = state()
            with pytest.raises(Boom), fail_in(model, cache):
                model(input_ids=ids, attention_mask=mask, **{hf_paged.CACHE_KWARG: cache})
            after = state()
            evicted = after[4] - before[4]  # the step's evictions stand (full pages); nothing else changes
            assert after[:2] == before[:2] and after[5] == before[5]
            assert (after[2], after[3]) == (before[2] - evicted * before[5], before[3] - evicted)
            if cache.token_log is not None:
                assert all(len(row) == before[0] for row in cache.token_log.tokens)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, **{hf_paged.CACHE_KWARG: cache}).logits[:, -1]
        logits.append(out)
        ids = out.argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    return torch.stack(logits)


class _fail_after_layer:
    """Raise in the MLP of decoder layer ``index`` (after its attention wrote the cache), once."""

    def __init__(self, index):
        self.index = index

    def __call__(self, model, cache):
        self.layer = model.model.layers[self.index].mlp
        return self

    def __enter__(self):
        def hook(module, args):
            self.handle.remove()
            raise Boom("injected failure")

        self.handle = self.layer.register_forward_pre_hook(hook)

    def __exit__(self, *exc):
        self.handle.remove()


class _fail_in_update:
    """Raise inside `PagedCache.update` of layer ``index`` (its group already planned the step), once."""

    def __init__(self, index):
        self.index = index

    def __call__(self, model, cache):
        self.layer = cache.layers[self.index]
        return self

    def __enter__(self):
        real = self.layer.update

        def update(*args, **kwargs):
            real(*args, **kwargs)
            raise Boom("injected failure")

        self.layer.update = update

    def __exit__(self, *exc):
        del self.layer.update


@pytest.mark.parametrize("kind", ["config", "model", "per_layer", "evicting"])
@pytest.mark.parametrize("arch,fail", [("llama", _fail_after_layer(1)), ("llama", _fail_in_update(1)),
                                       ("gemma3", _fail_after_layer(2)), ("gemma3", _fail_in_update(2))])
def test_failed_step_is_rolled_back_at_once_and_a_retry_is_exact(arch, fail, kind):
    """After a layer raises mid-step the cache reports and holds the state before the step (both groups
    of a hybrid model, or every layer's group of a per-layer bounded cache), and retrying gives the logits
    of a run without the failure. "evicting": a full pool of one-token pages, where every decode step
    evicts (a victim's page takes the new token in place, `recycle_plan`); the evictions of a failed step
    stand, so its retry attends what the step would have."""
    import torch

    import hf_paged
    from tiny_models import left_padded_batch, make_pair

    _, model = make_pair(arch)
    batch = left_padded_batch((9, 5))

    def cache():
        kwargs = {"config": dict(config=model.config), "model": dict(model=model),
                  "per_layer": dict(config=model.config, max_pages=64, eviction="score"),
                  "evicting": dict(config=model.config, max_pages=18, eviction="score", page_size=1)}[kind]
        return hf_paged.PagedCache(**{"page_size": 4, **kwargs})

    clean_cache = cache()
    clean = _decode(model, clean_cache, batch, steps=4)
    assert (clean_cache.stats()["evictions"] > 0) == (kind == "evicting")  # 2 rows x 9 tokens fill 18 pages
    for fail_at in (1, 3):
        retried = _decode(model, cache(), batch, steps=4, fail_at=fail_at, fail_in=fail)
        torch.testing.assert_close(retried, clean, rtol=0, atol=1e-5)


# --------------------------------------------------------------- 4: prefix pages and their model
def test_prefix_pages_are_never_reused_by_another_model():
    """A cache bound to model A, reset, then used by model B (same shapes, other weights): B gets its own
    K/V (logits of a fresh DynamicCache run of B), while A itself still reuses its pages."""
    import torch
    from transformers import DynamicCache

    import hf_paged
    from tiny_models import make_pair

    _, model_a = make_pair("llama", seed=0)
    ref_b, model_b = make_pair("llama", seed=1)
    hf_paged.PagedCache(model=model_b)  # B is bound to a cache of its own: its prefix hook is installed
    prompt = {"input_ids": torch.randint(3, 96, (1, 13), generator=torch.Generator().manual_seed(3))}
    prompt["attention_mask"] = torch.ones_like(prompt["input_ids"])
    kwargs = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)

    cache = hf_paged.PagedCache(page_size=4, model=model_a)
    model_a.generate(**prompt, **kwargs, **{hf_paged.CACHE_KWARG: cache})
    cache.reset()
    out_b = model_b.generate(**prompt, **kwargs, **{hf_paged.CACHE_KWARG: cache})
    assert cache.stats()["prefix_hits"] == 0
    want = ref_b.generate(**prompt, **kwargs, **{hf_paged.CACHE_KWARG: DynamicCache(config=ref_b.config)})
    assert torch.equal(out_b.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(out_b.logits), torch.stack(want.logits), rtol=0, atol=1e-4)

    cache.reset()  # the control: the model that computed the pages reuses them
    model_a.generate(**prompt, **kwargs, **{hf_paged.CACHE_KWARG: cache})
    assert cache.stats()["prefix_hits"] > 0


def test_fingerprint_covers_weights_dtype_and_page_size():
    import torch

    import hf_paged
    from tiny_models import make_pair

    _, model = make_pair("llama", seed=0)
    _, other = make_pair("llama", seed=1)
    cache, coarse = hf_paged.PagedCache(page_size=4, model=model), hf_paged.PagedCache(page_size=8, model=model)
    root = cache.fingerprint(model)
    assert root == cache.fingerprint(model)
    assert root != cache.fingerprint(other) and root != coarse.fingerprint(model)
    assert root != cache.fingerprint(model.to(dtype=torch.bfloat16))


# ----------------------------------------------------------------------------- 6: clear errors
def _tiny_seq2seq(name):
    import transformers

    if name == "t5":
        config = transformers.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                       decoder_start_token_id=0)
    else:
        config = transformers.BartConfig(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2,
                                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                         decoder_ffn_dim=64, max_position_embeddings=64)
    return transformers.AutoModelForSeq2SeqLM.from_config(config).eval()


@pytest.mark.parametrize("name", ["t5", "bart"])
@pytest.mark.parametrize("bound", [False, True])
def test_encoder_decoder_models_are_refused_clearly(name, bound):
    import torch

    import hf_paged

    model = _tiny_seq2seq(name)
    with pytest.raises(hf_paged.CacheUsageError, match="decoder-only"):
        cache = hf_paged.PagedCache(config=model.config) if bound else hf_paged.PagedCache()
        model.generate(input_ids=torch.randint(3, 96, (1, 7)), max_new_tokens=3, **{hf_paged.CACHE_KWARG: cache})


def test_pickling_a_cache_says_what_works(tmp_path):
    import copy
    import pickle

    import torch

    import hf_paged
    from tiny_models import make_pair

    _, model = make_pair("llama")
    cache = hf_paged.PagedCache(page_size=4, config=model.config)
    model(input_ids=torch.randint(3, 96, (1, 9)), **{hf_paged.CACHE_KWARG: cache})
    for save in (pickle.dumps, lambda c: torch.save(c, tmp_path / "cache.pt")):
        with pytest.raises(TypeError, match=r"fork\(\).*deepcopy"):
            save(cache)
    assert copy.deepcopy(cache).get_seq_length() == 9 == cache.get_seq_length()


@pytest.mark.parametrize("kwargs,match", [
    (dict(lru_threshold="0.5"), "lru_threshold must be a number"),
    (dict(lru_threshold=None), "lru_threshold must be a number"),
    (dict(config="str"), "config must be a transformers model config"),
    (dict(model=42), "model must be a transformers model"),
    (dict(page_size=10**9), "page_size must be a positive int of at most 65536"),
])
def test_bad_arguments_say_what_is_wrong(kwargs, match):
    import hf_paged

    with pytest.raises(hf_paged.CacheUsageError, match=match):
        hf_paged.PagedCache(**kwargs)


def test_a_model_of_other_shapes_after_reset_is_told_about_bind_config():
    import torch
    from transformers import DynamicCache

    import hf_paged
    from tiny_models import make_pair

    _, llama = make_pair("llama")  # 2 KV heads
    ref, neox = make_pair("gpt_neox")  # 4 KV heads
    prompt = torch.randint(3, 96, (1, 9))
    cache = hf_paged.PagedCache(page_size=4, config=llama.config)
    llama.generate(input_ids=prompt, max_new_tokens=2, **{hf_paged.CACHE_KWARG: cache})
    cache.reset()
    with pytest.raises(hf_paged.CacheUsageError, match=r"holds no tokens: call cache.bind_config\(model.config\)"):
        neox.generate(input_ids=prompt, max_new_tokens=2, **{hf_paged.CACHE_KWARG: cache})
    cache.bind_config(neox.config)
    got = neox.generate(input_ids=prompt, max_new_tokens=5, do_sample=False, **{hf_paged.CACHE_KWARG: cache})
    want = ref.generate(input_ids=prompt, max_new_tokens=5, do_sample=False,
                        **{hf_paged.CACHE_KWARG: DynamicCache(config=ref.config)})
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------ 7: threads
def test_a_cache_used_by_a_second_thread_raises_a_clear_error():
    """Concurrently (two threads start together) or one after the other: the thread that does not own the
    cache gets a CacheUsageError, and the owner's tokens are those of a cache of its own."""
    import threading

    import torch

    import hf_paged
    from tiny_models import left_padded_batch, make_pair

    _, model = make_pair("llama")
    batch = left_padded_batch((9, 5))
    kwargs = dict(max_new_tokens=12, do_sample=False)
    want = model.generate(**batch, **kwargs, **{hf_paged.CACHE_KWARG: hf_paged.PagedCache(page_size=4)})

    shared = hf_paged.PagedCache(page_size=4)
    start, results = threading.Barrier(2), {}

    def run(name):
        start.wait()
        try:
            results[name] = model.generate(**batch, **kwargs, **{hf_paged.CACHE_KWARG: shared})
        except hf_paged.CacheUsageError as error:
            results[name] = error

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results.values() if isinstance(r, Exception)]
    outputs = [r for r in results.values() if not isinstance(r, Exception)]
    assert len(errors) == 1 and "serves one thread" in str(errors[0])
    assert len(outputs) == 1 and torch.equal(outputs[0], want)

    with pytest.raises(hf_paged.CacheUsageError, match="serves one thread"):
        model(**batch, **{hf_paged.CACHE_KWARG: shared})  # this (main) thread never owned it


# ------------------------------------------------------------------- chunked attention (Llama 4)
def _tiny_llama4(seed=0):
    import copy

    import torch
    import transformers

    import hf_paged

    config = transformers.Llama4TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
        attention_chunk_size=6, floor_scale=4, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    assert config.layer_types.count("chunked_attention") == 6 and config.attn_temperature_tuning
    torch.manual_seed(seed)
    ref = transformers.Llama4ForCausalLM(copy.deepcopy(config)).eval()
    paged_config = copy.deepcopy(config)
    paged_config._attn_implementation = hf_paged.ATTN_IMPLEMENTATION
    paged = transformers.Llama4ForCausalLM(paged_config).eval()
    paged.load_state_dict(ref.state_dict())
    return ref, paged


def test_chunked_attention_layers_keep_their_chunk_window_and_match_dynamic_cache():
    """Llama 4: chunked layers attend within chunks of 6 tokens; their pages older than the window are
    freed, and greedy tokens and logits equal DynamicCache's (NoPE layers' temperature tuning included)."""
    import torch
    from transformers import DynamicCache

    import hf_paged
    from tiny_models import left_padded_batch

    ref, paged = _tiny_llama4()
    batch = left_padded_batch((13, 7))
    kwargs = dict(max_new_tokens=14, do_sample=False, output_logits=True, return_dict_in_generate=True)
    want = ref.generate(**batch, **kwargs, **{hf_paged.CACHE_KWARG: DynamicCache(config=ref.config)})
    cache = hf_paged.PagedCache(page_size=2, config=paged.config)
    got = paged.generate(**batch, **kwargs, **{hf_paged.CACHE_KWARG: cache})
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-4)
    chunked, full = cache.groups[6], cache.groups[None]
    assert set(cache.groups) == {6, None}
    assert chunked.tokens_stored() <= 2 * (6 + 2) < full.tokens_stored() == 2 * (13 + 13)
