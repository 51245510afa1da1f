"""Prefix caching: a cache bound to a model (``PagedCache(model=model)``) reuses cached pages of a prompt.

Pages are reused only when their chained content hash matches, and a reused run must compute exactly what
a fresh full forward with DynamicCache computes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

import hf_paged
import hf_paged.prefix_index
from hf_paged.prefix_index import page_hashes
from page_checks import check_all_given_back, check_pages
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 96


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_prefix_cache_reuses_pages_after_reset(name):
    ref, paged = make_pair(name)  # own pair: binding installs a forward hook on the model
    S, shared = 8, 24
    g = torch.Generator().manual_seed(3)
    first = torch.randint(3, VOCAB, (2, 29), generator=g)
    second = torch.cat([first[:1, :shared].expand(2, -1), torch.randint(3, VOCAB, (2, 6), generator=g)], 1)
    inputs = lambda ids: dict(input_ids=ids, attention_mask=torch.ones_like(ids))  # noqa: E731
    gen = dict(max_new_tokens=5, pad_token_id=0, eos_token_id=None, do_sample=False)

    cache = hf_paged.PagedCache(page_size=S, model=paged)
    seen = []
    hook = paged.register_forward_pre_hook(lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        assert torch.equal(paged.generate(**inputs(first), **gen, cache=cache), ref.generate(**inputs(first), **gen))
        assert cache.stats()["prefix_hits"] == 0 and seen[0] == (2, 29)
        cache.reset()
        assert cache.stats()["pages_used"] == 0 and cache.stats()["pages_cached"] > 0
        seen.clear()
        got = paged.generate(**inputs(second), **gen, cache=cache)
    finally:
        hook.remove()
    assert torch.equal(got, ref.generate(**inputs(second), **gen, cache=DynamicCache(config=ref.config)))
    assert seen[0] == (2, second.shape[1] - shared), seen  # only the new tokens were computed
    assert all(shape == (2, 1) for shape in seen[1:])
    # reused pages: 3 full pages per row for full attention; a sliding group needs only its window
    expected = 0
    for window in cache.groups:
        first_needed = 0 if window is None else max(0, shared - window + 1) // S
        expected += 2 * (shared // S - first_needed)
    assert cache.stats()["prefix_hits"] == expected > 0
    full = cache.groups[None]  # both rows share the first prompt's cached pages
    assert full.rows[0][:shared // S] == full.rows[1][:shared // S]
    check_pages(cache)
    managers = [g.manager for g in cache.groups.values()]
    cache.reset()
    for manager in managers:
        check_all_given_back(manager)
        assert manager.cached  # full pages stay cached for the next prompt


def test_page_hashes_are_stable_across_processes():
    tokens, mask = list(range(3, 43)), [0, 0] + [1] * 38
    here = [h.hex() for h in page_hashes(tokens, mask, list(range(40)), 8, 0, b"")]
    assert len(here) == 5 and len(set(here)) == 5
    # load the module by path: importing the package (transformers) would take most of the time
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('pc', {hf_paged.prefix_index.__file__!r}); "
            "pc = importlib.util.module_from_spec(spec); spec.loader.exec_module(pc); "
            f"print(','.join(h.hex() for h in pc.page_hashes({tokens}, {mask}, list(range(40)), 8, 0, b'')))")
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().split(",") == here
    assert page_hashes(tokens, [1] * 40, list(range(40)), 8, 0, b"")[0].hex() != here[0]  # the mask is content
    assert page_hashes(tokens, mask, list(range(1, 41)), 8, 0, b"")[0].hex() != here[0]  # so are positions
    assert page_hashes(tokens, mask, list(range(40)), 8, 0, b"x")[0].hex() != here[0]  # and the parent

