"""Exact match as an `evaluate` metric, loadable offline from this folder (the hub's
``evaluate-metric/exact_match`` needs a download):

    metric = evaluate.load("/abs/path/to/integrations/exact_match_metric")
    metric.compute(predictions=["71432", "1234"], references=["71432", "4321"])  # {"exact_match": 0.5}

A prediction matches when it equals its reference after stripping surrounding whitespace.
"""

import datasets
import evaluate

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str), references (list of str): compared pairwise after strip().
Returns:
    exact_match (float): the share of equal pairs (0.0 for no pairs).
"""


class ExactMatchMetric(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric", description=__doc__, citation="", inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references):
        pairs = list(zip(predictions, references))
        return {"exact_match": sum(p.strip() == r.strip() for p, r in pairs) / len(pairs) if pairs else 0.0}
