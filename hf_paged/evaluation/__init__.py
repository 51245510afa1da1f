"""What the comparison studies in ``scripts/`` are made of; each script there is an argument parser and a call.

Shared pieces:
- `caches`: the two caches compared (`DynamicCache` + "sdpa", `PagedCache` + "hf_paged") and what they hold;
  `StudyStore`, a script's ``--prefix-store`` shared by the caches it makes, and their store counters;
- `text`: a text (the embedded Britannica article, a ``datasets`` dataset, a file) as token ids;
- `nll`: scoring a token sequence through one cache, chunk by chunk at explicit positions;
- `intervals`: paired bootstrap intervals of a perplexity ratio;
- `memory`: a process's (or CUDA allocator's) peak memory growth over a run;
- `run_info`: versions, load average and source fingerprint recorded with every result;
- `formats`: argument types, number formats and the JSON writer of the reports.
- `quantized_peer`: transformers' QuantizedCache (optimum-quanto), the peer of quantized pages, or why it is absent.

Studies (one module each, driven by the script of the same name): `perplexity` (scripts/perplexity.py),
`long_context` (scripts/evaluation.py), `benchmark` (scripts/benchmark.py), `many_prompts`
(scripts/many_prompts.py), `sharing` (scripts/sharing_memory.py), `quantized` (scripts/quantized.py),
`prefix_store` and `store_throughput` (scripts/prefix_store.py). Heavy packages (accelerate, matplotlib,
scipy, evaluate) are imported where they are used; these modules are not imported by ``import hf_paged``.
"""
