"""The kernels never trust their page tables (issue 11, item 3): bad indices are refused with a ValueError naming
the argument, without a crash (in a fresh interpreter), and page ids are checked once per step, not per layer."""

from __future__ import annotations

import textwrap

import pytest

from subprocess_checks import needs_cc, run_python


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
