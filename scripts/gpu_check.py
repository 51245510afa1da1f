"""Prepared GPU check: copy bandwidth, decode-kernel bandwidth, SDPA/flash comparison, end-to-end
generate (PagedCache vs DynamicCache + sdpa), a GPU/CPU split model and sampled `generate_many`.

    python scripts/gpu_check.py --out OUT_DIR          # on a machine with one CUDA GPU
    python scripts/gpu_check.py --out OUT_DIR --dry-run   # CPU, tiny shapes, Triton interpreter

Every part runs in its own try/except; errors are recorded in OUT_DIR/gpu_check.json (which is
rewritten after every part, so a run killed by a timeout still leaves the finished parts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch  # (does not import triton: main() can still set TRITON_INTERPRET before hf_paged loads it)
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
TARGETS = {"kernel_fraction_of_copy_bw_at_B32_ctx8k": 0.70, "e2e_paged_over_dynamic_sdpa_at_4k": 1.0}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_check.json")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, kernel via TRITON_INTERPRET=1")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    return ap.parse_args(argv)


class Check:
    """One run's settings and results: ``results[part]`` is rewritten to ``out/gpu_check.json`` after every part."""

    def __init__(self, args):
        self.dry = args.dry_run
        self.cuda = torch.cuda.is_available() and not self.dry
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        self.reps, self.warmup = (2, 1) if self.dry else (args.reps, args.warmup)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results: dict = {"dry_run": self.dry, "device": str(self.dev), "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name(0) if self.cuda else None, "targets": TARGETS}

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=2, default=str))

    def run(self, part) -> None:
        """Run ``part(self, r)``; store its dict ``r`` (or the error text) under ``results[part.__name__]``."""
        name = part.__name__
        t0 = time.perf_counter()
        self.results[name] = {}
        try:
            part(self, self.results[name])
        except Exception as e:  # noqa: BLE001 - record and go on with the next part
            self.results[name]["error"] = f"{type(e).__name__}: {e}"
            self.results[name]["traceback"] = traceback.format_exc(limit=8)
            print(f"[{name}] FAILED: {type(e).__name__}: {e}", flush=True)
        self.results[name]["part_seconds"] = round(time.perf_counter() - t0, 2)
        if self.cuda:
            torch.cuda.empty_cache()
        self.save()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def bench(self, fn, reps=None, warmup=None) -> float:
        """Median seconds of fn(); CUDA events on the GPU, perf_counter on the CPU."""
        reps, warmup = reps or self.reps, warmup or self.warmup
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


# ----------------------------------------------------------------------------- a. copy bandwidth
def copy_bandwidth(check: Check, r: dict) -> None:
    n = (1 << 18) if check.dry else (1 << 28)  # float32: 1 MiB dry, 1 GiB real
    src = torch.randn(n, device=check.dev)
    dst = torch.empty(n, device=check.dev)
    t = check.bench(lambda: dst.copy_(src))
    nbytes = 2 * n * src.element_size()  # read + written
    r.update(bytes_read_plus_written=nbytes, seconds=t, GBps=nbytes / t / 1e9)
    del src, dst


# ------------------------------------------------------------- b/c. decode kernel vs SDPA / flash
def decode_kernel(check: Check, r: dict) -> None:
    from hf_paged.kernels.triton_paged_attention import paged_attention_triton

    try:
        from flash_attn import flash_attn_func  # optional package
    except Exception as e:  # noqa: BLE001
        flash_attn_func = None
        r["flash_attn_package"] = f"unavailable: {type(e).__name__}: {e}"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if check.dry:
        Hq, Hkv, D, S, dtype = 4, 2, 32, 16, torch.float32
        batches, contexts = (1, 2), (64, 128)
    else:
        Hq, Hkv, D, S, dtype = 32, 8, 128, 16, torch.bfloat16
        batches, contexts = (1, 8, 32), (1024, 8192, 32768)
    r.update(Hq=Hq, Hkv=Hkv, D=D, page_size=S, dtype=str(dtype), configs=[])
    copy_gbps = check.results.get("copy_bandwidth", {}).get("GBps")
    scale = D ** -0.5
    g = torch.Generator(device="cpu").manual_seed(0)
    for B in batches:
        for T in contexts:
            c = {"batch": B, "context": T}
            r["configs"].append(c)
            k_pool = v_pool = k = v = None
            try:
                N = T // S
                P = B * N
                kv_bytes = 2 * P * S * Hkv * D * torch.tensor([], dtype=dtype).element_size()
                c["kv_bytes"] = kv_bytes
                if check.cuda:
                    free, _ = torch.cuda.mem_get_info()
                    if 2.6 * kv_bytes > free:  # pools + contiguous copies for SDPA + slack
                        c["skipped"] = f"needs ~{2.6 * kv_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
                        continue
                k_pool = torch.randn(P, S, Hkv, D, device=check.dev, dtype=dtype)
                v_pool = torch.randn(P, S, Hkv, D, device=check.dev, dtype=dtype)
                perm = torch.randperm(P, generator=g).to(torch.int32)  # shuffled pages
                page_table = perm.view(B, N).to(check.dev)
                page_pos = (torch.arange(N, dtype=torch.int32) * S).expand(B, N).contiguous().to(check.dev)
                q_pos = torch.full((B, 1), T - 1, dtype=torch.int32, device=check.dev)
                q = torch.randn(B, Hq, 1, D, device=check.dev, dtype=dtype)
                out = torch.empty(B, 1, Hq, D, device=check.dev, dtype=dtype)

                def kern():
                    return paged_attention_triton(q, k_pool, v_pool, page_table, page_pos, q_pos, scale=scale, out=out)

                t = check.bench(kern)
                c.update(kernel_s=t, kernel_GBps=kv_bytes / t / 1e9)
                if copy_gbps:
                    c["kernel_fraction_of_copy_bw"] = kv_bytes / t / 1e9 / copy_gbps
                ko = kern().transpose(1, 2).float()  # [B, Hq, 1, D]

                # same K/V, contiguous [B, Hkv, T, D]
                idx = page_table.long()
                k = k_pool[idx].reshape(B, T, Hkv, D).transpose(1, 2).contiguous()
                v = v_pool[idx].reshape(B, T, Hkv, D).transpose(1, 2).contiguous()
                k_pool = v_pool = None  # free the pools before timing SDPA
                try:
                    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)  # noqa: E731
                    ts = check.bench(sdpa)
                    c.update(sdpa_s=ts, sdpa_GBps=kv_bytes / ts / 1e9, kernel_speedup_vs_sdpa=ts / t,
                             max_abs_diff_vs_sdpa=(sdpa().float() - ko).abs().max().item())
                except Exception as e:  # noqa: BLE001
                    c["sdpa_error"] = f"{type(e).__name__}: {e}"
                if check.cuda:
                    try:
                        def sdpa_flash():
                            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
                        tf = check.bench(sdpa_flash)
                        c.update(sdpa_flash_s=tf, kernel_speedup_vs_sdpa_flash=tf / t)
                    except Exception as e:  # noqa: BLE001
                        c["sdpa_flash_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                if flash_attn_func is not None:
                    try:
                        qf, kf, vf = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
                        fa = lambda: flash_attn_func(qf, kf, vf, softmax_scale=scale)  # noqa: E731
                        tfa = check.bench(fa)
                        c.update(flash_attn_s=tfa, kernel_speedup_vs_flash_attn=tfa / t)
                        kf = vf = None
                    except Exception as e:  # noqa: BLE001
                        c["flash_attn_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            except torch.OutOfMemoryError as e:
                c["skipped"] = f"OOM: {str(e)[:200]}"
            except Exception as e:  # noqa: BLE001
                c["error"] = f"{type(e).__name__}: {e}"
                c["traceback"] = traceback.format_exc(limit=6)
            finally:
                k_pool = v_pool = k = v = None
                if check.cuda:
                    torch.cuda.empty_cache()
            print(f"[decode_kernel] B={B} T={T}: " + ", ".join(
                f"{k_}={v_:.4g}" if isinstance(v_, float) else f"{k_}={v_}" for k_, v_ in c.items()
                if k_ not in ("batch", "context", "traceback")), flush=True)


# --------------------------------------------------------------------------- d. end-to-end generate
def count_kernel_calls():
    """Wrap the Triton kernel so that calls are counted (attention.py imports it at call time)."""
    from hf_paged.kernels import triton_paged_attention as mod
    calls = [0]
    orig = mod.paged_attention_triton

    def wrapped(*a, **k):
        calls[0] += 1
        return orig(*a, **k)
    mod.paged_attention_triton = wrapped
    return calls, lambda: setattr(mod, "paged_attention_triton", orig)


def end_to_end(check: Check, r: dict) -> None:
    import hf_paged
    from transformers import DynamicCache

    from hf_paged.assets import britannica_text, load_model_and_tokenizer

    context, new = (64, 5) if check.dry else (4096, 64)
    dtype = torch.float32 if check.dry else torch.bfloat16
    r.update(context=context, new_tokens=new, batch=1, dtype=str(dtype))
    t0 = time.perf_counter()
    paged, tok = load_model_and_tokenizer("smollm2", dtype=dtype, device=check.dev, attn_implementation="hf_paged")
    ref, _ = load_model_and_tokenizer("smollm2", dtype=dtype, device=check.dev, attn_implementation="sdpa")
    r["load_seconds"] = time.perf_counter() - t0
    ids = tok(britannica_text(), return_tensors="pt").input_ids[:, :context].to(check.dev)
    r["prompt_tokens"] = ids.shape[1]
    mask = torch.ones_like(ids)

    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Called once per generated token, after that step's forward: sync and take the time."""
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            check.sync()
            self.t.append(time.perf_counter())
            return scores

    def gen(model, cache_fn, n, clock=None):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=tok.pad_token_id,
                                  logits_processor=LogitsProcessorList([clock] if clock else []),
                                  **{hf_paged.CACHE_KWARG: cache_fn(model)})

    backend = "triton" if check.dry else None  # dry run: the interpreted Triton kernel (auto = the C kernel on the CPU)
    variants = {"paged": (paged, lambda m: hf_paged.PagedCache(page_size=16, config=m.config, backend=backend)),
                "dynamic_sdpa": (ref, lambda m: DynamicCache(config=m.config))}
    seqs = {}
    reps = 1 if check.dry else 3
    calls, restore = count_kernel_calls()
    try:
        for name, (model, cache_fn) in variants.items():
            gen(model, cache_fn, 2)  # warm-up (Triton compile, cuBLAS handles)
            before = calls[0]
            prefill, decode, total = [], [], []
            for _ in range(reps):
                clock = StepClock()
                check.sync()
                t0 = time.perf_counter()
                out = gen(model, cache_fn, new, clock)
                check.sync()
                total.append(time.perf_counter() - t0)
                prefill.append(clock.t[0] - t0)  # prefill + first token
                decode.append((len(clock.t) - 1) / (clock.t[-1] - clock.t[0]))  # tokens/s after the first
            seqs[name] = out[0, ids.shape[1]:].tolist()
            r[name] = {"prefill_s": statistics.median(prefill), "total_s": statistics.median(total),
                       "decode_tokens_per_s": statistics.median(decode),
                       "triton_kernel_calls_per_generate": (calls[0] - before) // reps}
    finally:
        restore()
    r["paged_over_dynamic_decode"] = r["paged"]["decode_tokens_per_s"] / r["dynamic_sdpa"]["decode_tokens_per_s"]
    a, b = seqs["paged"], seqs["dynamic_sdpa"]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    r.update(tokens_match=a == b, matching_prefix_tokens=same, generated_tokens=len(a))
    if a != b:
        r["paged_text"], r["dynamic_text"] = tok.decode(a), tok.decode(b)
    del paged, ref


# ---------------------------------------------------------------------- e. GPU/CPU split model
def layer_info(model):
    """Where each decoder layer's weights are and where accelerate executes it."""
    info = []
    for i, layer in enumerate(model.model.layers):
        p = next(layer.parameters())
        hook = getattr(layer, "_hf_hook", None)
        info.append({"layer": i, "param_device": str(p.device),
                     "execution_device": str(getattr(hook, "execution_device", None)) if hook else None,
                     "offloaded": bool(getattr(hook, "offload", False)) if hook else False})
    return info


def split_model(check: Check, r: dict) -> None:
    import hf_paged
    from transformers import AutoConfig, DynamicCache

    from hf_paged.assets import britannica_text, load_model_and_tokenizer, resolve_model_path

    gpu = "cuda:0" if check.cuda else "cpu"  # dry run: both halves on the CPU, same code path
    n_layers = AutoConfig.from_pretrained(resolve_model_path("smollm2")).num_hidden_layers
    half = n_layers // 2
    # embed_tokens and lm_head are tied in SmolLM2: keep both on the first device
    device_map = {"model.embed_tokens": gpu, "lm_head": gpu, "model.rotary_emb": gpu, "model.norm": "cpu"}
    device_map.update({f"model.layers.{i}": gpu if i < half else "cpu" for i in range(n_layers)})
    r["device_map"] = {"layers_on_first_device": f"0..{half - 1} -> {gpu}", "rest": "cpu"}
    dtype = torch.float32 if check.dry else torch.bfloat16
    new = 4

    def run(model, tok, cache):
        ids = tok(britannica_text()[:2000], return_tensors="pt").input_ids[:, :64]
        ids = ids.to(model.model.embed_tokens.weight.device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id,
                                 **{hf_paged.CACHE_KWARG: cache})
        return out[0, ids.shape[1]:].tolist()

    def cache_devices(cache):
        return [str(layer.device) if getattr(layer, "is_initialized", False) else None for layer in cache.layers]

    def summarize(devs):
        return {d: [i for i, x in enumerate(devs) if x == d] for d in sorted(set(map(str, devs)))}

    # 1. accelerate device_map (accelerate may offload the "cpu" layers and run them on the GPU)
    acc = r["accelerate_device_map"] = {}
    try:
        paged, tok = load_model_and_tokenizer("smollm2", dtype=dtype, device_map=device_map,
                                              attn_implementation="hf_paged")
        acc["hf_device_map_values"] = sorted(set(map(str, getattr(paged, "hf_device_map", {}).values())))
        acc["layers"] = summarize([f"param={x['param_device']} exec={x['execution_device']} offload={x['offloaded']}"
                                   for x in layer_info(paged)])
        cache = hf_paged.PagedCache(page_size=16, config=paged.config)
        a = run(paged, tok, cache)
        acc["paged_cache_keys_device_per_layer"] = summarize(cache_devices(cache))
        del paged
        ref, _ = load_model_and_tokenizer("smollm2", dtype=dtype, device_map=device_map, attn_implementation="sdpa")
        dyn = DynamicCache(config=ref.config)
        b = run(ref, tok, dyn)
        acc["dynamic_cache_keys_device_per_layer"] = summarize(cache_devices(dyn))
        acc.update(paged_tokens=a, dynamic_tokens=b, tokens_match=a == b)
        del ref
    except Exception as e:  # noqa: BLE001
        acc["error"] = f"{type(e).__name__}: {e}"
        acc["traceback"] = traceback.format_exc(limit=8)
    check.save()

    # 2. manual split: layers really execute on the CPU; pre-hooks move inputs to each layer's device
    man = r["manual_split"] = {}
    try:
        def to_dev(x, d):
            if torch.is_tensor(x):
                return x.to(d)
            if isinstance(x, tuple):
                return tuple(to_dev(y, d) for y in x)
            return x

        def split(attn):
            model, tok = load_model_and_tokenizer("smollm2", dtype=dtype, attn_implementation=attn)
            model.model.embed_tokens.to(gpu)  # tied lm_head follows
            model.model.rotary_emb.to(gpu)
            for i, layer in enumerate(model.model.layers):
                d = torch.device(gpu if i < half else "cpu")
                layer.to(d)
                layer.register_forward_pre_hook(
                    lambda m, a, k, d=d: (to_dev(a, d), {n: to_dev(v, d) for n, v in k.items()}), with_kwargs=True)
            model.model.norm.register_forward_pre_hook(lambda m, a: to_dev(a, torch.device("cpu")))
            model.lm_head.register_forward_pre_hook(lambda m, a: to_dev(a, torch.device(gpu)))
            return model, tok

        paged, tok = split("hf_paged")
        man["layers"] = summarize([x["param_device"] for x in layer_info(paged)])
        cache = hf_paged.PagedCache(page_size=16, config=paged.config)
        a = run(paged, tok, cache)
        man["paged_cache_keys_device_per_layer"] = summarize(cache_devices(cache))
        del paged
        ref, _ = split("sdpa")
        dyn = DynamicCache(config=ref.config)
        b = run(ref, tok, dyn)
        man["dynamic_cache_keys_device_per_layer"] = summarize(cache_devices(dyn))
        man.update(paged_tokens=a, dynamic_tokens=b, tokens_match=a == b)
        del ref
    except Exception as e:  # noqa: BLE001
        man["error"] = f"{type(e).__name__}: {e}"
        man["traceback"] = traceback.format_exc(limit=8)


# ------------------------------------------------------------------- f. sampled generate_many on the device
def sampled_generate_many(check: Check, r: dict) -> None:
    """`generate_many` sampling on the device (top-p, two samples a prompt): it must run (a CPU generator drawing
    from device probabilities raised on CUDA), each output must equal its prompt sampled alone with its documented
    seed (batching changes nothing), and the outputs are compared with a CPU run of the same model (float32 on
    both: equal where the two devices' logits lead to the same draws)."""
    import hf_paged
    from hf_paged.assets import britannica_prompts, load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("smollm2", dtype=torch.float32, device=check.dev,
                                          attn_implementation="hf_paged")
    samples, seed = 2, 7
    prompts = britannica_prompts(3 if check.dry else 12, 5, 40, seed=0)
    kwargs = dict(tokenizer=tok, max_new_tokens=4 if check.dry else 24, do_sample=True, temperature=0.8, top_p=0.95,
                  eos_token_id=[], progress=False)
    t0 = time.perf_counter()
    batched = hf_paged.generate_many(model, prompts, num_return_sequences=samples, seed=seed, **kwargs)
    check.sync()
    r.update(prompts=len(prompts), samples=samples, seconds=time.perf_counter() - t0, dtype="float32")
    alone = [hf_paged.generate_many(model, [p], seed=seed + i * samples + j, **kwargs)[0]
             for i, p in enumerate(prompts) for j in range(samples)]
    r["outputs_equal_alone"] = f"{sum(a == b for a, b in zip(batched, alone))}/{len(batched)}"
    r["independent_of_batching"] = batched == alone
    if check.cuda:
        model.to("cpu")
        on_cpu = hf_paged.generate_many(model, prompts, num_return_sequences=samples, seed=seed, **kwargs)
        r["outputs_equal_cpu"] = f"{sum(a == b for a, b in zip(batched, on_cpu))}/{len(batched)}"
        r["tokens_equal_cpu"] = (f"{sum(x == y for a, b in zip(batched, on_cpu) for x, y in zip(a, b))}/"
                                 f"{sum(len(a) for a in batched)}")
    r["first_output"] = tok.decode(batched[0])
    del model


# ------------------------------------------------------------------------------------ summary
def fmt(x, spec=".3g"):
    return "-" if x is None else (format(x, spec) if isinstance(x, (int, float)) else str(x))


def summary(check: Check) -> str:
    """The results as a table for the log."""
    lines = ["", "=" * 100, f"gpu_check summary ({'DRY RUN, cpu' if check.dry else check.results['gpu']})", "=" * 100]
    cb = check.results.get("copy_bandwidth", {})
    lines.append(f"copy bandwidth (read+write): {fmt(cb.get('GBps'), '.1f')} GB/s {cb.get('error', '')}")
    dk = check.results.get("decode_kernel", {})
    if "error" in dk:
        lines.append(f"decode kernel: ERROR {dk['error']}")
    lines.append(f"{'B':>3} {'ctx':>6} {'kernel GB/s':>11} {'%copy':>6} {'kern us':>9} {'sdpa us':>9} {'x sdpa':>7} "
                 f"{'flash us':>9} {'x flash':>7} {'maxdiff':>8}  note")
    for c in dk.get("configs", []):
        fl_s = c.get("flash_attn_s", c.get("sdpa_flash_s"))
        fl_x = c.get("kernel_speedup_vs_flash_attn", c.get("kernel_speedup_vs_sdpa_flash"))
        frac = c.get("kernel_fraction_of_copy_bw")
        note = c.get("skipped") or c.get("error") or ""
        if c["batch"] == 32 and c["context"] == 8192:
            note += f" target >=70% copy bw: {'PASS' if frac and frac >= 0.70 else 'FAIL'}"
        us = lambda s: None if s is None else s * 1e6  # noqa: E731
        lines.append(f"{c['batch']:>3} {c['context']:>6} {fmt(c.get('kernel_GBps'), '.1f'):>11} "
                     f"{fmt(None if frac is None else 100 * frac, '.1f'):>6} {fmt(us(c.get('kernel_s')), '.1f'):>9} "
                     f"{fmt(us(c.get('sdpa_s')), '.1f'):>9} {fmt(c.get('kernel_speedup_vs_sdpa'), '.2f'):>7} "
                     f"{fmt(us(fl_s), '.1f'):>9} {fmt(fl_x, '.2f'):>7} {fmt(c.get('max_abs_diff_vs_sdpa'), '.2g'):>8}  {note}")
    e2e = check.results.get("end_to_end", {})
    if "error" in e2e:
        lines.append(f"end-to-end: ERROR {e2e['error']}")
    else:
        ratio = e2e.get("paged_over_dynamic_decode")
        lines.append(f"end-to-end ctx={e2e.get('prompt_tokens')} +{e2e.get('new_tokens')}: paged "
                     f"{fmt(e2e['paged']['decode_tokens_per_s'], '.1f')} tok/s (triton calls "
                     f"{e2e['paged']['triton_kernel_calls_per_generate']}), dynamic+sdpa "
                     f"{fmt(e2e['dynamic_sdpa']['decode_tokens_per_s'], '.1f')} tok/s, ratio {fmt(ratio, '.2f')} "
                     f"(target >=1.0: {'PASS' if ratio and ratio >= 1.0 else 'FAIL'}), tokens match: "
                     f"{e2e.get('tokens_match')} ({e2e.get('matching_prefix_tokens')}/{e2e.get('generated_tokens')})")
    sp = check.results.get("split_model", {})
    if "error" in sp:
        lines.append(f"split model: ERROR {sp['error']}")
    for key in ("accelerate_device_map", "manual_split"):
        s = sp.get(key, {})
        if "error" in s:
            lines.append(f"split {key}: ERROR {s['error']}")
        elif s:
            lines.append(f"split {key}: paged keys per device {s.get('paged_cache_keys_device_per_layer')}; "
                         f"tokens match DynamicCache: {s.get('tokens_match')}")
            if key == "accelerate_device_map":
                lines.append(f"    accelerate layers: {s.get('layers')}")
    sg = check.results.get("sampled_generate_many", {})
    if "error" in sg:
        lines.append(f"sampled generate_many: ERROR {sg['error']}")
    elif sg:
        lines.append(f"sampled generate_many: {sg.get('prompts')} prompts x {sg.get('samples')} samples in "
                     f"{fmt(sg.get('seconds'), '.2f')} s; equal to each prompt alone: {sg.get('outputs_equal_alone')} "
                     f"(target: all); equal to the CPU run: {sg.get('outputs_equal_cpu', '-')} outputs, "
                     f"{sg.get('tokens_equal_cpu', '-')} tokens")
    lines.append(f"JSON: {check.out / 'gpu_check.json'}")
    return "\n".join(lines)


PARTS = (copy_bandwidth, decode_kernel, end_to_end, split_model, sampled_generate_many)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (hf_paged's kernels)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    check = Check(args)
    for part in PARTS:
        check.run(part)
    print(summary(check), flush=True)


if __name__ == "__main__":
    main()
