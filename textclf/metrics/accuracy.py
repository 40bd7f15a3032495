"""Accuracy as an `evaluate` metric, kept in the repository so that it loads with no network.

`evaluate.load("accuracy")` fetches its script from the Hugging Face Hub; this is the same metric.
"""

import datasets
import evaluate
from sklearn.metrics import accuracy_score


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to the references.",
            citation="",
            inputs_description="predictions and references: lists of class ids",
            features=datasets.Features({"predictions": datasets.Value("int32"),
                                        "references": datasets.Value("int32")}),
        )

    def _compute(self, predictions, references):
        return {"accuracy": float(accuracy_score(references, predictions))}
