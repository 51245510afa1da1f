"""Long-context evaluation of bounded caches: what a budget of B tokens keeps, on real text (the study behind
scripts/evaluation.py, whose docstring lists its tasks, regimes and arguments).

Every task shares one model, text and set of token ids. Caches are fed through `CacheStream` (explicit positions:
a cache that holds fewer tokens than it processed keeps later positions right); `Held` checks the budget. kvpress's
presses run in their own environment (scripts/kvpress_runner.py, handed the model folder and token ids) and land
in the same tables. Paths to integrations/ and scripts/ are the repository's: run from a checkout.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

import hf_paged

from .. import assets
from .formats import pyplot, write_json
from .nll import CacheStream
from .nll import perplexity as ppl
from .run_info import versions
from .text import load_token_ids

ROOT = Path(__file__).resolve().parents[2]  # the repository
TASKS = ("continuation", "passkey", "streaming")
REGIMES = ("streaming", "compress", "compress+grow")
DEFAULT_POLICIES = ("score", "lru", "fifo+sinks")
POLICIES = (*DEFAULT_POLICIES, "score+heads")  # score+heads: "score" per KV head (per_head_eviction, page size 1)
# kvpress presses; adakv_<press>: AdaKVPress (head-wise budgets, pruned keys masked) around <press>;
# decoding_<press>: DecodingPress around <press>, the stream fed in chunks and cut back to B after every forward
DECODING = "decoding_"
PRESSES = ("streaming_llm", "tova", "expected_attention", "snapkv", "adakv_snapkv", "adakv_expected_attention",
           "decoding_tova")
KVPRESS_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"
PROMPT = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"
CHAT_QUESTION, CHAT_ANSWER = "\n\nWhat is the pass key?", "The pass key is"
PASSKEY_PROMPTS = ("chat", "plain")
QUICK = dict(windows=1, context=96, continuation=32, budgets=[32], lengths=[128], depths=[0.5],
             passkey_budgets=[32], trials=1, max_tokens=128, streaming_budgets=[32], page_size=8, chunk=8)


# ---------------------------------------------------------------------------------------- caches
def policy_kwargs(policy: str) -> dict:
    """PagedCache arguments of a policy; sinks are PagedCache's default (the pages of the first 4 tokens)."""
    if policy == "score+heads":
        return dict(eviction="score", per_head_eviction=True)
    return dict(eviction="fifo" if policy == "fifo+sinks" else policy)


def method_name(base: str, kv_format: str, interval: int | None = None) -> str:
    """A method's name in the tables: ``base`` with the page format unless it is "float" ("float+int4": float pages
    demoted to int4 under the budget's bytes), and its ``eviction_interval`` when one is given (None: the default)."""
    base = base if interval is None else f"{base}, interval {interval}"
    if "+" in kv_format:
        return f"{base}, cold {kv_format.split('+')[1]}"
    return base if kv_format == "float" else f"{base} {kv_format}"


def bounded_formats(args) -> list[str]:
    """The page formats of the bounded rows: each ``--kv-format``, then ``float+<cold>`` per ``--cold-format``
    (`PagedCache(cold_format=...)`: B float tokens' bytes per layer, the coldest pages re-quantized first)."""
    return list(args.kv_format) + [f"float+{cold}" for cold in getattr(args, "cold_format", None) or ()]


def unbounded_jobs(args, task: str, **where) -> list[dict]:
    """The full-context baseline (a DynamicCache), then an unbounded PagedCache per quantized ``--kv-format``: what
    the format alone costs, before any budget."""
    jobs = [dict(task=task, method="full", regime="full", policy=None, budget=None, kv_format="float", **where)]
    return jobs + [dict(task=task, method=f"full, {kv_format} pages", regime="full", policy=None, budget=None,
                        kv_format=kv_format, **where) for kv_format in args.kv_format if kv_format != "float"]


def job_cache(job, models, args):
    """(model, cache) of a job: a DynamicCache for the full baseline, else a PagedCache with the job's page format,
    unbounded for the other full-context rows."""
    if job["regime"] != "full":
        model = models["paged"]
        return model, bounded_cache(model, args, job["policy"], job["regime"], job["budget"], job["kv_format"])
    if job["kv_format"] == "float":
        from transformers import DynamicCache

        return models["dynamic"], DynamicCache(config=models["dynamic"].config)
    model = models["paged"]
    return model, hf_paged.PagedCache(page_size=args.page_size, config=model.config, kv_format=job["kv_format"])


def bounded_cache(model, args, policy: str, regime: str, budget: int, kv_format: str = "float") -> hf_paged.PagedCache:
    kv_format, _, cold_format = kv_format.partition("+")
    return hf_paged.PagedCache(page_size=args.page_size, max_pages=budget // args.page_size, config=model.config,
                               kv_format=kv_format, cold_format=cold_format or None,
                               compress_prompt=regime.startswith("compress"),
                               per_layer_eviction=None if args.per_layer_eviction == "on" else False,
                               score_decay=args.score_decay, observation_window=args.observation_window,
                               score_heads=args.score_heads, recent_pages=args.recent_pages,
                               score_signal=args.score_signal if policy == "score" else None,
                               eviction_interval=args.eviction_interval, **policy_kwargs(policy))


class Held:
    """Most tokens a cache held during any forward (the budget check; nothing for a DynamicCache), called after every
    forward. A prompt that a ``compress_prompt`` cache takes whole is held whole until its step commits (then cut to
    the bound): `prompt` records that."""

    def __init__(self, cache):
        self.cache, self.peak = cache, 0
        self.paged = isinstance(cache, hf_paged.PagedCache)

    def __call__(self) -> None:
        if self.paged:
            self.peak = max(self.peak, self.cache.stats()["tokens_held"])

    def prompt(self, tokens: int) -> None:
        if self.paged:
            self.peak = max(self.peak, tokens)


def prefill(stream: CacheStream, ids: torch.Tensor, regime: str, chunk: int, held: Held) -> torch.Tensor:
    """Write ``ids`` into the stream's cache, whole or (``streaming`` regime) in chunks; the last token's logits
    ``[V]``. ``compress+grow`` then lifts the bound: the prompt was cut to B, what follows is added on top of it, as
    kvpress does."""
    logits = stream.feed(ids[None], chunk if regime == "streaming" else None)[0]
    if regime.startswith("compress"):
        held.prompt(len(ids))
    if regime == "compress+grow":
        stream.cache.set_max_pages(None)
    return logits


# ----------------------------------------------------------------------------------- continuation
def continuation_nll(model, cache, x: torch.Tensor, context: int, regime: str, chunk: int) -> tuple:
    """NLL of ``x[context:]`` given ``x[:context]`` through ``cache``; (nll [N], peak tokens held)."""
    held = Held(cache)
    stream = CacheStream(model, cache, hf_paged.CACHE_KWARG, after_forward=held)
    first = prefill(stream, x[:context], regime, chunk, held)
    return stream.score_after(first, x[context:], chunk if regime != "full" else None), held.peak


def continuation_jobs(args) -> list[dict]:
    jobs = [job for w in range(args.windows) for job in unbounded_jobs(args, "continuation", window=w)]
    for kv_format, regime, policy, budget in itertools.product(bounded_formats(args), args.regimes, args.policies,
                                                               args.budgets):
        method = method_name(f"hf_paged {policy}", kv_format, args.eviction_interval)
        jobs += [dict(task="continuation", method=method, regime=regime, policy=policy, budget=budget,
                      kv_format=kv_format, window=w) for w in range(args.windows)]
    return jobs


def run_continuation_job(job, models, ids, args) -> dict:
    span = args.context + args.continuation
    x = ids[job["window"] * span:(job["window"] + 1) * span]
    model, cache = job_cache(job, models, args)
    nll, peak = continuation_nll(model, cache, x, args.context, job["regime"], args.chunk)
    out = dict(nll_sum=math.fsum(nll.tolist()), tokens=len(nll), peak_tokens_held=peak, nll=nll.tolist(),
               block_nll=block_sums(nll.tolist()))
    if isinstance(cache, hf_paged.PagedCache):
        stats = cache.stats()
        out.update(tokens_held=stats["tokens_held"], evictions=stats["evictions"], kv_bytes=stats["kv_bytes"])
    return out


def block_sums(nll: list[float], size: int = 64) -> list[float]:
    """A job's ``block_nll``: the NLL sums of its scored tokens in runs of ``size`` (scripts/paired_rows.py pairs
    rows of separate runs by them)."""
    return [math.fsum(nll[i:i + size]) for i in range(0, len(nll), size)]


def window_blocks(rs: list[dict], block: int) -> tuple[list[float], list[int]] | None:
    """(NLL sums, token counts) of a row's blocks: each window's scored tokens in runs of ``block`` (the last one
    shorter), windows in order; None when a job kept no per-token NLL."""
    if any("nll" not in r for r in rs):
        return None
    sums, counts = [], []
    for r in sorted(rs, key=lambda r: r["window"]):
        for i in range(0, len(r["nll"]), block):
            sums.append(math.fsum(r["nll"][i:i + block]))
            counts.append(len(r["nll"][i:i + block]))
    return sums, counts


def best_presses(rows: list[dict], regime: str | None = None) -> dict:
    """budget -> the kvpress row of lowest perplexity at that budget (of ``regime`` when one is given)."""
    best: dict = {}
    for r in rows:
        if r["library"] != "kvpress" or regime not in (None, r["regime"]):
            continue
        if r["budget"] not in best or r["perplexity"] < best[r["budget"]]["perplexity"]:
            best[r["budget"]] = r
    return best


def paired_against(rows: list[dict], blocks: dict, confidence: float = 0.95) -> list[dict]:
    """Each bounded row's perplexity relative to the full cache's, to the best press of its budget (`best_presses`;
    not the press itself) and, for a streaming row, to the best streaming press of its budget (a DecodingPress),
    ``ratio = ppl / ppl_ref - 1`` with a paired bootstrap interval over the windows' blocks
    (`intervals.paired_ratio_interval`): an interval that excludes 0 is a difference that holds across the blocks.
    Rows without blocks (or with other blocks than the reference's) are left out."""
    from .intervals import paired_ratio_interval

    def key(row):
        return row["method"], row["regime"], row["budget"]

    full = next(r for r in rows if r["method"] == "full")
    best, best_streaming = best_presses(rows), best_presses(rows, "streaming")
    out = []
    for r in rows:
        if r["budget"] is None:
            continue
        streaming = best_streaming.get(r["budget"]) if r["regime"] == "streaming" else None
        for kind, ref in (("full", full), ("best press", best.get(r["budget"])), ("best streaming press", streaming)):
            if ref is None or ref is r or blocks.get(key(r)) is None or blocks.get(key(ref)) is None:
                continue
            (mine, counts), (theirs, ref_counts) = blocks[key(r)], blocks[key(ref)]
            if counts != ref_counts:
                continue
            ratio, low, high = paired_ratio_interval(mine, theirs, counts, confidence)
            out.append(dict(method=r["method"], regime=r["regime"], budget=r["budget"], against=kind,
                            reference=ref["method"], ratio=ratio, low=low, high=high, confidence=confidence,
                            blocks=len(counts)))
    return out


def summarize_continuation(results: list[dict], kv: dict | None, block: int = 64) -> dict:
    """Rows per (method, regime, budget): pooled perplexity, excess over the full cache, tokens held; and
    ``paired``: each bounded row against the full cache and the best press of its budget (`paired_against`, over
    blocks of ``block`` scored tokens)."""
    groups: dict[tuple, list] = defaultdict(list)
    for r in results:
        groups[(r["method"], r["regime"], r["budget"])].append(r)
    rows = []
    for (method, regime, budget), rs in groups.items():
        nll, tokens = math.fsum(r["nll_sum"] for r in rs), sum(r["tokens"] for r in rs)
        rows.append(dict(library="kvpress" if method.startswith("kvpress") else "hf_paged", method=method,
                         regime=regime, budget=budget, windows=len(rs), tokens=tokens, nll_sum=nll,
                         perplexity=ppl(nll, tokens),
                         peak_tokens_held=max((r.get("peak_tokens_held") or 0) for r in rs),
                         tokens_held_after=max((r.get("tokens_held") or 0) for r in rs),
                         evictions=sum(r.get("evictions", 0) for r in rs)))
        if any("prefill_tokens_held" in r for r in rs):  # kvpress: what its cache holds after the compressed prefill
            rows[-1]["prefill_tokens_held"] = max(r.get("prefill_tokens_held") or 0 for r in rs)
    full = next(r["perplexity"] for r in rows if r["method"] == "full")
    for r in rows:
        r["excess"] = r["perplexity"] / full - 1
        r["within_budget"] = r["budget"] is None or r["peak_tokens_held"] <= r["budget"]
    blocks = {key: window_blocks(rs, block) for key, rs in groups.items()}
    return dict(full_perplexity=full, rows=rows, kvpress=kv, block=block, paired=paired_against(rows, blocks))


# ---------------------------------------------------------------------------------------- passkey
def passkey_frame(tokenizer, style: str) -> tuple[str, str]:
    """(text before the filler, text after it) of a pass-key prompt. ``plain``: the intro, then the question ending
    in "The pass key is"; ``chat``: intro, filler and question as the user's turn of the tokenizer's chat template,
    then the assistant's turn, begun with "The pass key is"."""
    if style == "plain":
        return PROMPT, QUESTION
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("--passkey-prompt chat: the tokenizer has no chat template; use --passkey-prompt plain")
    marker = "\x00filler\x00"
    rendered = tokenizer.apply_chat_template([dict(role="user", content=PROMPT + marker + CHAT_QUESTION)],
                                             tokenize=False, add_generation_prompt=True)
    before, after = rendered.split(marker)
    return before, after + CHAT_ANSWER


def passkey_cases(args, tokenizer, filler: torch.Tensor) -> list[dict]:
    """Prompts of exactly ``length`` tokens: intro, filler with the needle at ``depth``, question
    (`passkey_frame` of ``args.passkey_prompt``)."""
    g = torch.Generator().manual_seed(0)
    enc = lambda s: tokenizer(s, add_special_tokens=False, return_tensors="pt").input_ids[0]  # noqa: E731
    before, after = passkey_frame(tokenizer, args.passkey_prompt)
    cases = []
    for length in args.lengths:
        for depth in args.depths:
            for trial in range(args.trials):
                key = str(int(torch.randint(10000, 100000, (1,), generator=g)))
                head, needle, question = enc(before), enc(NEEDLE.format(key=key)), enc(after)
                n = length - len(head) - len(needle) - len(question)
                if n <= 0:
                    raise SystemExit(f"--lengths: {length} tokens leave no room for filler text")
                offset = (trial * 997) % max(1, len(filler) - n)
                text = filler[offset:offset + n]
                if len(text) < n:
                    raise SystemExit(f"the text has {len(filler)} tokens, {n} are needed as filler")
                cut = int(round(depth * n))
                ids = torch.cat([head, text[:cut], needle, text[cut:], question])
                cases.append(dict(case=len(cases), length=length, depth=depth, trial=trial, key=key,
                                  ids=ids.tolist()))
    return cases


def passkey_jobs(args, cases) -> list[dict]:
    jobs = [job for c in cases for job in unbounded_jobs(args, "passkey", case=c["case"])]
    for kv_format, regime, policy, budget in itertools.product(bounded_formats(args), args.regimes, args.policies,
                                                               args.passkey_budgets):
        method = method_name(f"hf_paged {policy}", kv_format, args.eviction_interval)
        jobs += [dict(task="passkey", method=method, regime=regime, policy=policy, budget=budget, kv_format=kv_format,
                      case=c["case"]) for c in cases]
    return jobs


def greedy(model, cache, ids: torch.Tensor, regime: str, chunk: int, new_tokens: int) -> tuple:
    """``new_tokens`` greedy tokens after the prompt ``ids``, through ``cache``; (tokens, peak tokens held)."""
    held = Held(cache)
    stream = CacheStream(model, cache, hf_paged.CACHE_KWARG, after_forward=held)
    return stream.greedy(prefill(stream, ids, regime, chunk, held), new_tokens), held.peak


def answer_of(text: str) -> str:
    """The first run of digits in a generated answer ('' when none)."""
    found = re.search(r"\d+", text)
    return found.group(0) if found else ""


def run_passkey_job(job, models, cases, args) -> dict:
    case = cases[job["case"]]
    ids = torch.tensor(case["ids"])
    model, cache = job_cache(job, models, args)
    tokens, peak = greedy(model, cache, ids, job["regime"], args.chunk, args.new_tokens)
    return dict(tokens=tokens, peak_tokens_held=peak)


def summarize_passkey(results: list[dict], cases: list[dict], tokenizer, kv: dict | None) -> dict:
    import evaluate

    metric = evaluate.load(str(ROOT / "integrations" / "exact_match_metric"))
    groups: dict[tuple, list] = {}
    for r in results:
        c = cases[r["case"]]
        r["answer"] = answer_of(tokenizer.decode(r["tokens"], skip_special_tokens=True))
        r["key"] = c["key"]
        groups.setdefault((r["method"], r["regime"], r["budget"], c["length"], c["depth"]), []).append(r)
    rows = []
    for (method, regime, budget, length, depth), rs in groups.items():
        em = metric.compute(predictions=[r["answer"] for r in rs], references=[r["key"] for r in rs])
        rows.append(dict(library="kvpress" if method.startswith("kvpress") else "hf_paged", method=method,
                         regime=regime, budget=budget, length=length, depth=depth, trials=len(rs),
                         accuracy=em["exact_match"], answers=[r["answer"] for r in rs],
                         peak_tokens_held=max((r.get("peak_tokens_held") or 0) for r in rs)))
    overall: dict[tuple, list] = {}
    for r in rows:
        overall.setdefault((r["method"], r["regime"], r["budget"]), []).append(r["accuracy"])
    summary = [dict(method=m, regime=g, budget=b, accuracy=sum(a) / len(a)) for (m, g, b), a in overall.items()]
    cases_out = [{k: v for k, v in c.items() if k != "ids"} for c in cases]
    return dict(cases=cases_out, rows=rows, summary=summary, kvpress=kv)


# -------------------------------------------------------------------------------------- streaming
def run_streaming_task(args, text: str) -> dict:
    """Streaming perplexity of ``text`` per policy and budget, through the `evaluate` perplexity module."""
    import evaluate

    metric = evaluate.load(str(ROOT / "integrations" / "perplexity_metric"))
    common = dict(predictions=[text], model_id=args.model, page_size=args.page_size, max_length=args.max_tokens,
                  batch_size=1, dtype=args.dtype, device="cpu" if args.cpu else None)
    full = metric.compute(**common)["mean_perplexity"]
    rows = [dict(policy="unbounded", budget=None, perplexity=full, excess=0.0)]
    for policy in args.policies:
        for budget in args.streaming_budgets:
            value = metric.compute(**common, max_pages=budget // args.page_size, chunk_size=args.chunk,
                                   **policy_kwargs(policy))["mean_perplexity"]
            rows.append(dict(policy=policy, budget=budget, perplexity=value, excess=value / full - 1))
    return dict(tokens=args.max_tokens, rows=rows)


# ---------------------------------------------------------------------------------------- kvpress
def kvpress_python(choice: str) -> Path | None:
    if choice == "off":
        return None
    path = KVPRESS_PYTHON if choice == "auto" else Path(choice)
    return path if path.exists() else None


def kvpress_request(args, ids, cases) -> dict:
    """What scripts/kvpress_runner.py runs: the model folder, the presses (`PRESSES`; ``adakv_<press>`` is
    AdaKVPress around ``<press>``; ``decoding_<press>`` streams in chunks of ``chunk``), and the token ids of every
    continuation window and pass-key case."""
    span = args.context + args.continuation
    request = dict(model=assets.resolve_model_path(args.model), dtype=args.dtype, threads=args.threads,
                   presses=args.presses, new_tokens=args.new_tokens, quiet=args.no_progress, chunk=args.chunk)
    if "continuation" in args.tasks:
        request["continuation"] = dict(context=args.context, budgets=args.budgets, windows=[
            ids[w * span:(w + 1) * span].tolist() for w in range(args.windows)])
    if "passkey" in args.tasks:
        request["passkey"] = [dict(case=c["case"], budget=b, ids=c["ids"]) for b in args.passkey_budgets for c in cases]
    return request


def press_regime(press: str) -> str:
    """The regime a press's rows belong to: ``streaming`` for a DecodingPress, else ``compress+grow``."""
    return "streaming" if press.startswith(DECODING) else "compress+grow"


def kvpress_results(answer: dict) -> tuple[list, list]:
    """(continuation results, passkey results) of the runner's answer, as job results of the press's regime
    (`press_regime`): per window the NLL of every continuation token and what the press's cache held (after the
    prefill: the full context for AdaKV, which masks pruned keys instead of removing them; streaming: the most keys a
    forward attended over); per case the generated tokens."""
    cont = []
    for r in answer["continuation"]:
        held = r.get("held") or [None] * len(r["nll"])
        streaming = press_regime(r["press"]) == "streaming"
        cont += [dict(task="continuation", method=f"kvpress {r['press']}", regime=press_regime(r["press"]),
                      budget=r["budget"], window=w, nll_sum=math.fsum(nll), tokens=len(nll), nll=nll,
                      block_nll=block_sums(nll),
                      peak_tokens_held=h if streaming else None, **({} if streaming else dict(prefill_tokens_held=h)))
                 for w, (nll, h) in enumerate(zip(r["nll"], held))]
    pk = [dict(task="passkey", method=f"kvpress {r['press']}", regime=press_regime(r["press"]), budget=r["budget"],
               case=r["case"], tokens=r["tokens"], peak_tokens_held=None) for r in answer["passkey"]]
    return cont, pk


def run_kvpress(args, ids, cases) -> tuple[dict, list, list]:
    """(status, continuation results, passkey results) of the presses, run in kvpress's environment; without it
    the status says why nothing ran."""
    python = kvpress_python(args.kvpress)
    if python is None:
        why = "off" if args.kvpress == "off" else f"{KVPRESS_PYTHON if args.kvpress == 'auto' else args.kvpress} absent"
        return dict(status=f"not run ({why}; scripts/make_kvpress_env.sh makes .venv-kvpress)"), [], []
    with tempfile.TemporaryDirectory() as tmp:
        req, ans = Path(tmp) / "request.json", Path(tmp) / "answer.json"
        req.write_text(json.dumps(kvpress_request(args, ids, cases)), encoding="utf-8")
        t0 = time.perf_counter()
        proc = subprocess.run([str(python), str(ROOT / "scripts" / "kvpress_runner.py"), str(req), str(ans)])
        if proc.returncode != 0:
            return dict(status=f"failed (exit status {proc.returncode})"), [], []
        answer = json.loads(ans.read_text(encoding="utf-8"))
    status = dict(status="ok", versions=answer["versions"], wall_s=time.perf_counter() - t0)
    return (status, *kvpress_results(answer))


# ----------------------------------------------------------------------------------------- output
def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def _interval(p: dict) -> str:
    return f"{100 * p['ratio']:+.2f}% [{100 * p['low']:+.2f}, {100 * p['high']:+.2f}]"


def paired_tables(cont: dict, budgets: list[int]) -> list[str]:
    """Markdown of the continuation's paired intervals, against the best press of each budget and the full cache."""
    lines = []
    for against in ("best press", "best streaming press", "full"):
        pairs = [p for p in cont.get("paired", ()) if p["against"] == against]
        if not pairs:
            continue
        keyed = {(p["method"], p["regime"], p["budget"]): p for p in pairs}
        refs = {p["budget"]: p["reference"] for p in pairs}
        title = (f"the {against} of each budget (" + ", ".join(f"B={b}: {refs[b]}" for b in budgets if b in refs)
                 + ")" if against != "full" else "the full cache")
        lines += ["", f"Perplexity relative to {title}, with a {100 * pairs[0]['confidence']:g}% paired bootstrap "
                  f"interval over {pairs[0]['blocks']} blocks of {cont['block']} scored tokens (an interval that "
                  "excludes 0: a difference that holds across the blocks):", "",
                  "| method | regime | " + " | ".join(f"B={b}" for b in budgets) + " |",
                  "|---|---|" + "---:|" * len(budgets)]
        for method, regime in dict.fromkeys((p["method"], p["regime"]) for p in pairs):
            cells = [_interval(keyed[(method, regime, b)]) if (method, regime, b) in keyed else "—" for b in budgets]
            lines.append(f"| {method} | {regime} | " + " | ".join(cells) + " |")
    held = {(r["method"], r["budget"]): r["prefill_tokens_held"] for r in cont["rows"] if "prefill_tokens_held" in r}
    if held:
        methods = list(dict.fromkeys(m for m, _ in held))
        lines += ["", "Tokens a kvpress cache holds per layer after the compressed prefill (AdaKV masks the keys it "
                  "prunes: its cache keeps the whole context):", "",
                  "| press | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---:|" * len(budgets)]
        lines += [f"| {m} | " + " | ".join(str(held.get((m, b), "—")) for b in budgets) + " |" for m in methods]
    return lines


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"# Long-context evaluation: {s['model']}, {report['text']['source']}", ""]
    cont = report.get("continuation")
    if cont:
        budgets = s["budgets"]
        lines += [f"## Continuation perplexity ({s['windows']} windows: {s['context']} context tokens held to B, "
                  f"the next {s['continuation']} scored; full cache {cont['full_perplexity']:.2f})", "",
                  "Excess perplexity over the full cache (lower is better); * = held more than B at some point "
                  "(compress: the prompt during prefill; compress+grow and kvpress's prefill presses: also the "
                  "continuation, on top of B).",
                  "",
                  "| method | regime | " + " | ".join(f"B={b}" for b in budgets) + " |",
                  "|---|---|" + "---:|" * len(budgets)]
        keyed = {(r["method"], r["regime"], r["budget"]): r for r in cont["rows"]}
        for method, regime in dict.fromkeys((r["method"], r["regime"]) for r in cont["rows"] if r["budget"]):
            cells = []
            for b in budgets:
                r = keyed.get((method, regime, b))
                over = r is not None and (not r["within_budget"] or (r["library"] == "kvpress"
                                                                     and r["regime"] != "streaming"))
                cells.append("—" if r is None else _pct(r["excess"]) + ("*" if over else ""))
            lines.append(f"| {method} | {regime} | " + " | ".join(cells) + " |")
        unbounded = [r for r in cont["rows"] if r["budget"] is None and r["method"] != "full"]
        if unbounded:
            lines += ["", "Unbounded caches with quantized pages (every context token held):", "",
                      "| method | perplexity | excess |", "|---|---:|---:|"]
            lines += [f"| {r['method']} | {r['perplexity']:.3f} | {_pct(r['excess'])} |" for r in unbounded]
        lines += paired_tables(cont, budgets)
        lines += ["", f"kvpress: {cont['kvpress']['status']}", ""]
    pk = report.get("passkey")
    if pk:
        frame = "the chat template" if s.get("passkey_prompt") == "chat" else "plain text"
        lines += [f"## Pass-key retrieval (lengths {s['lengths']}, depths {s['depths']}, {s['trials']} key(s) per "
                  f"cell; question at the end of the prompt, {frame})", "", "| method | regime | budget | accuracy |",
                  "|---|---|---:|---:|"]
        for r in pk["summary"]:
            lines.append(f"| {r['method']} | {r['regime']} | {r['budget'] or '—'} | {100 * r['accuracy']:.0f}% |")
        lines += ["", f"kvpress: {pk['kvpress']['status']}", ""]
    st = report.get("streaming")
    if st:
        lines += [f"## Streaming perplexity ({st['tokens']} tokens, chunks of {s['chunk']}, `evaluate` perplexity "
                  "module)", "", "| policy | budget | perplexity | excess |", "|---|---:|---:|---:|"]
        for r in st["rows"]:
            lines.append(f"| {r['policy']} | {r['budget'] or '—'} | {r['perplexity']:.3f} | {_pct(r['excess'])} |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, out: Path) -> list[str]:
    plt = pyplot()
    written = []
    cont = report.get("continuation")
    if cont:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        lines: dict[tuple, list] = {}
        for r in cont["rows"]:
            if r["budget"]:
                lines.setdefault((r["method"], r["regime"]), []).append((r["budget"], 100 * r["excess"]))
        for (method, regime), pts in lines.items():
            pts.sort()
            ax.plot(*zip(*pts), marker="o" if method.startswith("hf_paged") else "x",
                    ls="-" if regime == "streaming" else "--", label=f"{method} ({regime})")
        for r in cont["rows"]:
            if r["budget"] is None and r["method"] != "full":
                ax.axhline(100 * r["excess"], ls=":", color="gray", label=f"{r['method']} (unbounded)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["settings"]["budgets"], [str(b) for b in report["settings"]["budgets"]])
        ax.set_xlabel("budget B (context tokens held)")
        ax.set_ylabel("excess perplexity over the full cache (%)")
        ax.set_title(f"Continuation perplexity (full cache {cont['full_perplexity']:.2f})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "continuation.png", dpi=120)
        plt.close(fig)
        written.append("continuation.png")
    pk = report.get("passkey")
    if pk:
        s = report["settings"]
        panels = list(dict.fromkeys((r["method"], r["regime"], r["budget"]) for r in pk["rows"]))
        cols = min(4, len(panels))
        rows_n = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows_n, cols, figsize=(3.2 * cols, 2.8 * rows_n), squeeze=False)
        for ax, (method, regime, budget) in zip(axes.flat, panels):
            grid = torch.full((len(s["depths"]), len(s["lengths"])), float("nan"))
            for r in pk["rows"]:
                if (r["method"], r["regime"], r["budget"]) == (method, regime, budget):
                    grid[s["depths"].index(r["depth"]), s["lengths"].index(r["length"])] = r["accuracy"]
            ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(s["lengths"])), [str(x) for x in s["lengths"]])
            ax.set_yticks(range(len(s["depths"])), [f"{d:.0%}" for d in s["depths"]])
            ax.set_title(f"{method}\n{regime}, B={budget or 'all'}", fontsize=8)
            ax.set_xlabel("prompt length", fontsize=7)
            ax.set_ylabel("key depth", fontsize=7)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.tight_layout()
        fig.savefig(out / "passkey.png", dpi=110)
        plt.close(fig)
        written.append("passkey.png")
    return written


# ------------------------------------------------------------------------------------------- main
def main(args) -> int:
    """Run the tasks of ``args`` (scripts/evaluation.py's arguments); the main process writes the outputs."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    from ..distributed import deal, make_state

    state = make_state(cpu=True if args.cpu else None)
    t0 = time.perf_counter()
    with state.main_process_first():
        models, tokenizer = {}, None
        for kind, attn in (("dynamic", "sdpa"), ("paged", hf_paged.ATTN_IMPLEMENTATION)):
            models[kind], tokenizer = assets.load_model_and_tokenizer(
                args.model, dtype=assets.DTYPES[args.dtype], device=state.device, attn_implementation=attn)
        need = max(args.windows * (args.context + args.continuation), max(args.lengths) * 2, args.max_tokens)
        ids, text_info = load_token_ids(tokenizer, need, args.dataset, args.config, args.split, args.column,
                                        args.text_file)
    if "continuation" in args.tasks and len(ids) < args.windows * (args.context + args.continuation):
        raise SystemExit(f"the text has {len(ids)} tokens; --windows x (--context + --continuation) needs "
                         f"{args.windows * (args.context + args.continuation)}")
    cases = passkey_cases(args, tokenizer, ids) if "passkey" in args.tasks else []
    jobs = []
    if "continuation" in args.tasks:
        jobs += continuation_jobs(args)
    if "passkey" in args.tasks:
        jobs += passkey_jobs(args, cases)
    results = []
    with state.split_between_processes(deal(list(enumerate(jobs)), state.num_processes)) as mine:
        bar = tqdm(total=len(mine), desc=f"evaluate (rank {state.process_index})", dynamic_ncols=True,
                   disable=args.no_progress or not state.is_main_process)
        for index, job in mine:
            t = time.perf_counter()
            run = run_continuation_job if job["task"] == "continuation" else run_passkey_job
            data = ids if job["task"] == "continuation" else cases
            results.append(dict(job, index=index, **run(job, models, data, args),
                                wall_s=time.perf_counter() - t))
            bar.update(1)
        bar.close()
    results = sorted(gather_object(results), key=lambda r: r["index"])
    report = dict(settings={k: v for k, v in vars(args).items() if k != "no_progress"}, text=text_info)
    report["settings"].update(num_processes=state.num_processes, device=str(state.device),
                              torch_threads=torch.get_num_threads())
    if state.is_main_process:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "jobs.json", results, indent=None, strict=False)  # before anything can fail
        kv_status, kv_cont, kv_pk = run_kvpress(args, ids, cases) if args.tasks != ["streaming"] else ({}, [], [])
        if kv_cont or kv_pk:  # the presses' results beside hf_paged's (scripts/paired_rows.py joins them)
            write_json(out / "jobs.json", results + kv_cont + kv_pk, indent=None, strict=False)
        if "continuation" in args.tasks:
            report["continuation"] = summarize_continuation(
                [r for r in results if r["task"] == "continuation"] + kv_cont, kv_status, args.block)
        if "passkey" in args.tasks:
            report["passkey"] = summarize_passkey([r for r in results if r["task"] == "passkey"] + kv_pk, cases,
                                                  tokenizer, kv_status)
        if "streaming" in args.tasks:
            report["streaming"] = run_streaming_task(args, tokenizer.decode(ids[:args.max_tokens]))
        report.update(versions=versions(), wall_s=time.perf_counter() - t0)
        table = markdown(report)
        (out / "evaluate.md").write_text(table, encoding="utf-8")
        pngs = plot(report, out)
        write_json(out / "evaluate.json", report, indent=2)
        print(table)
        print("wrote", ", ".join(str(out / n) for n in ("evaluate.md", "evaluate.json", *pngs)))
    state.wait_for_everyone()
    if state.use_distributed:
        state.destroy_process_group()
    return 0

