"""Accuracy and macro-F1 as one `evaluate` metric, kept in the repository so that it loads with no network.

`evaluate.load("accuracy")` and `evaluate.load("f1")` fetch their scripts from the Hugging Face Hub;
this computes the same two scores (scikit-learn's, as those scripts do) in one pass.
"""

import datasets
import evaluate
from sklearn.metrics import accuracy_score, f1_score


class Classification(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Accuracy, and F1 averaged over the classes (macro).",
            citation="",
            inputs_description="predictions and references: lists of class ids; labels: the class ids to "
                               "average F1 over (default: those that occur)",
            features=datasets.Features({"predictions": datasets.Value("int32"),
                                        "references": datasets.Value("int32")}),
        )

    def _compute(self, predictions, references, labels=None):
        return {"accuracy": float(accuracy_score(references, predictions)),
                "f1": float(f1_score(references, predictions, average="macro", labels=labels, zero_division=0))}
