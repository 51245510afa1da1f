"""Generate with a paged KV cache on the embedded SmolLM2 model and compare with DynamicCache."""

import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.assets import load_model_and_tokenizer

model, tokenizer = load_model_and_tokenizer("smollm2", attn_implementation="hf_paged")
prompts = ["The capital of France is", "Shakespeare was born in", "A paged KV cache stores"]
inputs = tokenizer(prompts, return_tensors="pt", padding=True)

cache = hf_paged.PagedCache(page_size=16, config=model.config)
paged = model.generate(**inputs, max_new_tokens=24, do_sample=False, **{hf_paged.CACHE_KWARG: cache})

model.set_attn_implementation("sdpa")
stock = model.generate(**inputs, max_new_tokens=24, do_sample=False, **{hf_paged.CACHE_KWARG: DynamicCache(config=model.config)})

for text in tokenizer.batch_decode(paged, skip_special_tokens=True):
    print(repr(text))
print("identical to DynamicCache:", torch.equal(paged, stock))
print(cache.stats())
