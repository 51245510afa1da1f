"""The evaluate perplexity metric refuses bad arguments with a ValueError naming them, before loading a model
(issue 30, item 9: an empty list or ``chunk_size=-1`` ended in a ZeroDivisionError)."""

from pathlib import Path

import pytest

METRIC = Path(__file__).resolve().parents[1] / "integrations" / "perplexity_metric"


@pytest.fixture(scope="module")
def metric():
    evaluate = pytest.importorskip("evaluate")
    return evaluate.load(str(METRIC))


@pytest.mark.parametrize("kwargs,match", [
    (dict(predictions=[]), "predictions is empty"),
    (dict(chunk_size=-1), "chunk_size must be None or an int of at least 1, got -1"),
    (dict(chunk_size=0), "chunk_size must be None or an int"),
    (dict(batch_size=0), "batch_size must be an int of at least 1"),
    (dict(batch_size=2.5), "batch_size must be an int"),
    (dict(page_size=0), "page_size must be an int of at least 1"),
    (dict(max_pages=-2), "max_pages must be None or an int"),
    (dict(max_length=1), "max_length must be None or an int of at least 2"),
])
def test_bad_arguments_are_refused_before_a_model_loads(metric, kwargs, match):
    """``model_id`` names no model: reaching the loading step would raise an OSError instead."""
    call = {"predictions": ["One text to score."], "model_id": "/nonexistent/model", **kwargs}
    with pytest.raises(ValueError, match=match):
        metric.compute(**call)
