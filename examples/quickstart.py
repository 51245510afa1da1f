"""Generate with a paged KV cache on the embedded SmolLM2 model and compare with DynamicCache.

    python examples/quickstart.py      # about 10 seconds on a CPU (the first run converts the model: ~30 s more)
"""

import os

import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.assets import load_model_and_tokenizer
from hf_paged.evaluation.run_info import idle_cores

if "OMP_NUM_THREADS" not in os.environ:  # torch's default, a thread per core, crawls when the cores are busy
    torch.set_num_threads(idle_cores())

model, tokenizer = load_model_and_tokenizer("smollm2", attn_implementation="hf_paged")
prompts = ["The capital of France is", "Shakespeare was born in", "A paged KV cache stores"]
inputs = tokenizer(prompts, return_tensors="pt", padding=True)

cache = hf_paged.PagedCache(page_size=16, config=model.config)
paged = model.generate(**inputs, max_new_tokens=24, do_sample=False, **{hf_paged.CACHE_KWARG: cache})

model.set_attn_implementation("sdpa")
stock = model.generate(**inputs, max_new_tokens=24, do_sample=False,
                       **{hf_paged.CACHE_KWARG: DynamicCache(config=model.config)})

for text in tokenizer.batch_decode(paged, skip_special_tokens=True):
    print(repr(text))
print("identical to DynamicCache:", torch.equal(paged, stock))
print(cache.stats())
