"""Argument types, number formats and the JSON writer shared by the studies' reports."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive ints, e.g. "256,1024"."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def value_list(kind):
    """argparse type: comma-separated values of ``kind`` (at least one), e.g. ``value_list(float)("0.1,0.5")``."""
    def parse(text: str):
        try:
            values = [kind(x) for x in text.replace(" ", "").split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values
    return parse


def mib(nbytes, digits: int = 1) -> str:
    """Bytes as MiB with ``digits`` decimals."""
    return f"{nbytes / 2**20:.{digits}f}"


def finite(obj):
    """NaN / inf -> None (recursively), so that a report is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_json(path: Path, data, indent: int = 2, strict: bool = True, newline: bool = True) -> None:
    """``data`` as JSON at ``path``: with ``strict``, NaN and inf become null (`finite`); other values that JSON
    has no type for are written as their ``str``."""
    text = json.dumps(finite(data) if strict else data, indent=indent, default=str, allow_nan=not strict)
    Path(path).write_text(text + ("\n" if newline else ""), encoding="utf-8")


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display); matplotlib is the ``eval`` extra's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_report(out: Path, stem: str, markdown: str, data, plot=None, **json_options) -> None:
    """A study's outputs in ``out`` (made if missing): ``<stem>.md`` (``markdown``), ``<stem>.json`` (``data``,
    `write_json` with ``json_options``) and, with ``plot`` (a function of the PNG's path), ``<stem>.png``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(markdown, encoding="utf-8")
    write_json(out / f"{stem}.json", data, **json_options)
    if plot is not None:
        plot(out / f"{stem}.png")
