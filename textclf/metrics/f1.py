"""F1 as an `evaluate` metric, kept in the repository so that it loads with no network.

`evaluate.load("f1")` fetches its script from the Hugging Face Hub; this is the same metric.
"""

import datasets
import evaluate
from sklearn.metrics import f1_score


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Harmonic mean of precision and recall; `average` as in scikit-learn.",
            citation="",
            inputs_description="predictions and references: lists of class ids; average: 'macro' by default",
            features=datasets.Features({"predictions": datasets.Value("int32"),
                                        "references": datasets.Value("int32")}),
        )

    def _compute(self, predictions, references, average="macro", labels=None):
        return {"f1": float(f1_score(references, predictions, average=average, labels=labels, zero_division=0))}
