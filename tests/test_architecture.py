"""Structure the package keeps: no import cycles, attention independent of the cache, a prefix hook that
can be removed, and an explicit prefill beside the transparent generate path."""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import torch
from transformers import DynamicCache

import hf_paged
from tiny_models import make_pair

PACKAGE = Path(hf_paged.__file__).parent


def import_graph() -> dict[str, set[str]]:
    """Module -> package modules it imports anywhere, in functions too (relative imports of hf_paged)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        package = name.rsplit(".", 1)[0] if "." in name else ""
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if package else []
                target = ".".join([*filter(None, base), *(node.module.split(".") if node.module else [])])
                edges.add(target)
        graph[name] = edges
    return graph


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in graph.get(module, ()):
            assert state.get(target) != "open", f"import cycle: {' -> '.join([*path, target])}"
            if target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])


POOL_TENSORS = {"keys", "values", "k_pool", "v_pool"}  # a LayerPages' tensors, and the kernels' names for them
POOL_WRITES = {"index_copy_", "as_strided", "index_put_"}


def test_only_the_page_store_reads_or_writes_a_pool_tensor():
    """Outside page_store.py (and the kernels, which get the store's operands) no module names a pool tensor
    (``x.keys`` / ``x.values`` other than a dict's ``.keys()`` / ``.values()``) or writes slots in place."""
    for path in PACKAGE.rglob("*.py"):
        module = path.relative_to(PACKAGE).as_posix()
        if module == "page_store.py" or module.startswith("kernels/"):
            continue
        tree = ast.parse(path.read_text())
        bare_calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call) and not n.args and not n.keywords}
        touched = [f"{module}:{n.lineno} .{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                   and ((n.attr in POOL_TENSORS and id(n) not in bare_calls) or n.attr in POOL_WRITES)]
        assert not touched, f"a pool tensor outside the page store: {touched}"


def test_attention_does_not_import_the_cache():
    assert "cache" not in import_graph()["attention"]


def test_unbind_and_garbage_collection_remove_the_prefix_hook():
    _, paged = make_pair("llama")
    hooks = len(paged._forward_pre_hooks)
    cache = hf_paged.PagedCache(page_size=4, model=paged)
    assert len(paged._forward_pre_hooks) == hooks + 1
    cache.unbind()
    assert len(paged._forward_pre_hooks) == hooks and cache.token_log is None
    paged(torch.tensor([[5, 6, 7, 8, 9]]), **{hf_paged.CACHE_KWARG: cache})  # still a working, unbound cache
    assert cache.get_seq_length() == 5
    bound = hf_paged.PagedCache(page_size=4, model=paged)
    bound.fork()  # a fork holds its own hook, dropped with it
    del bound
    gc.collect()
    assert len(paged._forward_pre_hooks) == hooks


def test_prefill_reuses_pages_explicitly_and_a_plain_forward_computes_every_token():
    ref, paged = make_pair("llama")
    prompt = torch.randint(3, 96, (1, 14), generator=torch.Generator().manual_seed(3))
    cache = hf_paged.PagedCache(page_size=4, model=paged)
    full = paged(prompt, **{hf_paged.CACHE_KWARG: cache}).logits
    assert full.shape[1] == 14  # logits_to_keep=0 asks for every token: nothing trimmed
    cache.reset()
    out = cache.prefill(paged, prompt)
    assert cache.stats()["prefix_hits"] == 3  # pages 0-2 reused; the last token (page 3) computed
    want = ref(prompt, **{hf_paged.CACHE_KWARG: DynamicCache()}).logits[:, -1:]
    torch.testing.assert_close(out.logits, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(full, ref(prompt).logits, rtol=1e-4, atol=1e-4)


CACHE_INTERNALS = {"group", "layer", "layers", "step", "policy", "tracks_usage", "manager", "seen", "rows"}


def attribute_names(module: str) -> set[str]:
    """Every ``x.name`` read or written in ``hf_paged/<module>.py``."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def test_attention_reads_only_the_view_not_cache_internals():
    for module in ("attention", "paged_kv"):
        touched = attribute_names(module) & CACHE_INTERNALS
        assert not touched, f"{module}.py reaches into the cache: .{', .'.join(sorted(touched))}"


def class_lengths() -> dict[str, int]:
    """``module.Class`` -> lines of every class in the package."""
    lengths = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lengths[f"{path.stem}.{node.name}"] = node.end_lineno - node.lineno + 1
    return lengths


def test_page_group_is_split_by_concern():
    """Rows, steps, plans, eviction state, layers and the attention view: each its own class of modest size."""
    lengths = class_lengths()
    for name in ("page_group.PageGroup", "page_rows.PageRows", "step_plan.StepPlan", "eviction.GroupEviction",
                 "cache_layer.PagedLayer", "paged_kv.PagedView"):
        assert lengths[name] <= 220, f"{name} has {lengths[name]} lines"


def test_layers_never_touch_their_siblings_or_their_groups_members():
    """Membership (which layer wrote which tokens) is the group's: no module outside page_group.py reads or
    writes a layer's written-token count, and no layer calls another layer's private methods."""
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        assert "seen" not in names, f"{path.name} uses a layer's .seen"
        calls = [node.func for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("_")
                 and not node.func.attr.startswith("__") and isinstance(node.func.value, ast.Name)
                 and node.func.value.id == "layer"]
        assert not calls, f"{path.name} calls a private method of another layer"


def test_the_cache_delegates_to_its_groups():
    """PagedCache edits no page tables and reads no block manager: its groups do (PageGroups spans them)."""
    touched = attribute_names("cache") & {"rows", "manager", "free", "cached", "seen", "first_page", "abort_step",
                                          "register_hashes", "can_restore", "_finish_or_rollback"}
    assert not touched, f"cache.py reaches into its groups: .{', .'.join(sorted(touched))}"
    assert class_lengths()["cache.PagedCache"] <= 230  # ~200: PageGroups, PrefixCaching and ThreadOwner hold the rest
