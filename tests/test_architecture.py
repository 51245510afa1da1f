"""Structure the package keeps: one page store that alone touches pool tensors, one sequence core and one view under
both caches, the ragged cache independent of the rectangular one, no import cycles (scripts included), eviction and
prefix registration each in one place, names with one meaning, a short steady decode path, a prefix hook that can be
removed, and an explicit prefill beside the transparent generate path."""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import pytest
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


SCRIPTS = PACKAGE.parent / "scripts"


def script_graph() -> dict[str, set[str]]:
    """Script -> the sibling scripts and package modules it imports anywhere (``scripts/`` is on the path)."""
    names = {path.stem for path in SCRIPTS.glob("*.py")}
    graph = {}
    for path in SCRIPTS.glob("*.py"):
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for module in modules:
                if module.split(".")[0] in names:
                    edges.add(f"scripts/{module.split('.')[0]}")
                elif module.startswith("hf_paged."):
                    edges.add(module.removeprefix("hf_paged."))
        graph[f"scripts/{path.stem}"] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in graph.get(module, ()):
            if state.get(target) == "open":
                return [*path, target]
            if target not in state:
                found = visit(target, [*path, target])
                if found:
                    return found
        state[module] = "done"
        return None

    for module in graph:
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"b"}}) is None


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_no_import_cycle_among_the_scripts_and_the_package():
    cycle = find_cycle({**import_graph(), **script_graph()})
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


RECTANGULAR = {"cache", "layer_groups", "step_plan", "prefix_reuse"}  # PagedCache's own modules


def imported_by(module: str, graph: dict[str, set[str]]) -> set[str]:
    """Every package module ``module`` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_ragged_cache_imports_nothing_of_the_rectangular_cache():
    graph = import_graph()
    assert RECTANGULAR <= set(graph), "a rectangular module was renamed: update RECTANGULAR"
    for module in ("ragged_cache", "scheduler", "continuous_batching", "page_store", "page_tables", "prefix_index"):
        rectangular = imported_by(module, graph) & RECTANGULAR
        assert not rectangular, f"{module} imports {rectangular}"


POOL_TENSORS = {"keys", "values", "k_pool", "v_pool"}  # a LayerPages' tensors, and the kernels' names for them
POOL_WRITES = {"index_copy_", "as_strided", "index_put_"}


def test_only_the_page_store_reads_or_writes_a_pool_tensor():
    """Outside page_store.py (and the kernels, which get the store's operands, and the evaluation tools, which also
    read transformers' own DynamicCache) no module names a pool tensor (``x.keys`` / ``x.values`` other than a dict's
    ``.keys()`` / ``.values()``) or writes slots in place."""
    for path in PACKAGE.rglob("*.py"):
        module = path.relative_to(PACKAGE).as_posix()
        if module == "page_store.py" or module.startswith(("kernels/", "evaluation/")):
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


CACHE_INTERNALS = {"group", "layer", "layers", "step", "policy", "tracks_usage", "manager", "rows", "sequences"}


def attribute_names(module: str) -> set[str]:
    """Every ``x.name`` read or written in ``hf_paged/<module>.py``."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def test_attention_reads_only_the_view_not_cache_internals():
    touched = attribute_names("attention") & CACHE_INTERNALS
    assert not touched, f"attention.py reaches into the cache: .{', .'.join(sorted(touched))}"


def class_lengths() -> dict[str, int]:
    """``module.Class`` -> lines of every class in the package."""
    lengths = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lengths[f"{path.stem}.{node.name}"] = node.end_lineno - node.lineno + 1
    return lengths


def test_the_classes_stay_small():
    """Rows, steps, plans, eviction state, layers and the attention view: each its own class of modest size."""
    lengths = class_lengths()
    for name in ("layer_groups.LayerGroup", "page_tables.PageRows", "step_plan.StepPlan", "eviction.GroupEviction",
                 "cache.PagedLayer", "attention.PagedView", "ragged_cache.RaggedCache", "page_store.PageStore"):
        assert lengths[name] <= 220, f"{name} has {lengths[name]} lines"


def test_the_cache_delegates_to_its_groups():
    """PagedCache edits no page tables and reads no block manager: its groups do (LayerGroups spans them)."""
    tree = next(node for node in ast.walk(ast.parse((PACKAGE / "cache.py").read_text()))
                if isinstance(node, ast.ClassDef) and node.name == "PagedCache")
    touched = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)} & {
        "rows", "manager", "free", "cached", "first_page", "abort_step", "register_hashes", "can_restore",
        "_finish_or_rollback"}
    assert not touched, f"cache.py reaches into its groups: .{', .'.join(sorted(touched))}"
    assert class_lengths()["cache.PagedCache"] <= 230  # ~200: LayerGroups, PrefixReuse and ThreadOwner hold the rest


def calls_to(name: str) -> dict[str, int]:
    """Module -> how many calls of ``name`` (a function or a method) it makes."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        n = sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call)
                and (getattr(node.func, "attr", None) == name or getattr(node.func, "id", None) == name))
        if n:
            found[path.relative_to(PACKAGE).as_posix()] = n
    return found


def test_copy_on_write_rollback_kernel_index_view_and_prefix_registration_each_exist_once():
    """Both caches plan with the sequence core: one copy-on-write, one undo of a failed step, one kernel index (the
    one caller of `mark_checked` outside the kernels and the kernel timings of the evaluation tools), one data-less
    view tensor, one prefix registration (the one writer of the block manager's hashes)."""
    assert {m: n for m, n in calls_to("mark_checked").items() if not m.startswith("evaluation/")} == {
        "page_tables.py": 1}
    assert calls_to("set_hash") == {"prefix_index.py": 1}
    assert calls_to("_make_wrapper_subclass") == {"attention.py": 1}
    for shared in ("copy_on_write", "StepUndo", "register_pages"):
        assert {"page_tables.py", "ragged_cache.py"} & set(calls_to(shared)), shared
    assert {"layer_groups.py", "ragged_cache.py"} <= set(calls_to("copy_on_write")) & set(calls_to("StepUndo"))
    assert {"ragged_cache.py", "step_plan.py"} <= set(calls_to("kernel_index"))
    defined = [node.name for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.ClassDef, ast.FunctionDef))]
    for name in ("copy_on_write", "StepUndo", "register_pages", "PagedView", "PagedKV"):
        assert defined.count(name) == 1, name
    assert "RaggedView" not in defined and "RaggedKV" not in defined and "RowsUndo" not in defined


EVICTION_INTERNALS = {"history", "victim_columns", "whole_shares", "fold_last_shares", "evict",
                      "recycle", "extend_plan", "recycle_plan", "PlanColumns"}


def test_eviction_lives_in_one_module():
    """Victims, their ranking, the plans of evicting steps and the usage signal are eviction.py's; other modules
    call its hooks. Only the block manager and `set_max_pages` change a pool's bound (a compressed prompt overdraws
    it for one step instead of unbounding it)."""
    for path in PACKAGE.rglob("*.py"):
        module = path.relative_to(PACKAGE).as_posix()
        if module == "eviction.py":
            continue
        tree = ast.parse(path.read_text())
        names = {getattr(n, "attr", None) or getattr(n, "id", None) for n in ast.walk(tree)}
        assert not names & EVICTION_INTERNALS, f"{module} uses {names & EVICTION_INTERNALS}"
        bound = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign))
                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                 if getattr(t, "attr", None) in ("max_pages", "bound")
                 and not (isinstance(t.value, ast.Name) and t.value.id == "self")]
        assert not bound or module == "layer_groups.py", f"{module}:{bound} sets a pool's bound"


def test_names_say_one_thing():
    """`window` is a sliding window (eviction observes the last queries: `observation_window`), `sink` an attention
    sink (attention reports usage to a probe), `usage` what attention reports in a step (the policy's memory is a
    history), a `row` a row of one batch (continuous batching schedules sequences); modules are named by their
    concept."""
    modules = {path.relative_to(PACKAGE).with_suffix("").as_posix() for path in PACKAGE.rglob("*.py")}
    assert not modules & {"page_group", "page_groups", "page_rows", "window", "paged_kv", "cache_layer",
                          "prefix_cache", "prefix_hook"}
    defined = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                defined.setdefault(node.name, set()).add(path.stem)
    assert defined["TokenLog"] == {"prefix_reuse"} and defined["PrefixReuse"] == {"prefix_reuse"}
    assert "sink" not in defined and "PageUsage" not in defined and "PrefixCaching" not in defined
    assert "Row" not in defined and defined["Sequence"] == {"scheduler"}
    for module in ("scheduler", "continuous_batching"):
        names = {n.id for n in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())) if isinstance(n, ast.Name)}
        assert not names & {"row", "rows"}, module
    for path in PACKAGE.rglob("*.py"):
        attributes = {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
        assert not attributes & {"observed_window", "usage_callback", "sink"}, path.name


def modules_entered(run, start: str, stop: set[str]) -> dict[str, set[str]]:
    """The package modules whose functions run between the first call of ``start`` (``module.py:function``) and
    the call of a function in ``stop`` (calls inside it not counted), over one call of ``run``."""
    import os
    import sys

    root, seen, on = str(PACKAGE), {}, [False]

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(root):
            return
        module = os.path.relpath(frame.f_code.co_filename, root)
        name = f"{module}:{frame.f_code.co_name}"
        on[0] = on[0] or name == start
        if on[0]:
            seen.setdefault(module, set()).add(frame.f_code.co_name)
        if frame.f_code.co_name in stop:
            on[0] = False

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


KERNELS = {"paged_attention_cpu", "plain_attention_cpu"}


def test_a_steady_decode_step_enters_few_modules():
    """One steady decode step of a PagedCache (unbounded, CPU kernel) from `PagedCache.update` to the kernel call,
    and one decode step of `generate_many`'s RaggedCache from planning to the kernel call, each enter at most 8
    package modules (13 before the page store and the sequence core)."""
    if hf_paged.backends.cpu_kernel.unavailable_reason() is not None:
        pytest.skip("no C compiler: the CPU kernel is not built")
    _, model = make_pair("llama")
    cache = hf_paged.PagedCache(page_size=16, backend="cpu")
    model(torch.randint(3, 90, (2, 20)), **{hf_paged.CACHE_KWARG: cache})
    model(torch.tensor([[5], [6]]), **{hf_paged.CACHE_KWARG: cache})  # the first decode step builds the plan
    steady = modules_entered(lambda: model(torch.tensor([[7], [8]]), **{hf_paged.CACHE_KWARG: cache}),
                             "cache.py:update", KERNELS)
    assert len(steady) <= 8, sorted(steady)
    assert "eviction.py" not in steady  # an unbounded cache never enters eviction

    ragged = hf_paged.RaggedCache(model.config, page_size=16, backend="cpu")
    ragged.add_sequence(0)
    ragged.add_sequence(1)

    def step(new_tokens, tokens, positions):
        ragged.begin_step(new_tokens)
        model(input_ids=torch.tensor([tokens]), position_ids=torch.tensor([positions]), use_cache=True,
              **{hf_paged.CACHE_KWARG: ragged})
        ragged.finish_step()

    step([(0, 5), (1, 4)], list(range(3, 12)), [0, 1, 2, 3, 4, 0, 1, 2, 3])  # two prefills
    step([(0, 1), (1, 1)], [7, 8], [5, 4])
    packed = modules_entered(lambda: step([(0, 1), (1, 1)], [9, 9], [6, 5]), "ragged_cache.py:begin_step", KERNELS)
    assert len(packed) <= 8, sorted(packed)


def test_layers_never_call_each_others_private_methods():
    for path in PACKAGE.rglob("*.py"):
        calls = [node.func for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("_")
                 and not node.func.attr.startswith("__") and isinstance(node.func.value, ast.Name)
                 and node.func.value.id == "layer"]
        assert not calls, f"{path.name} calls a private method of another layer"
