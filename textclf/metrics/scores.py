"""Every task's scores as one `evaluate` metric with a config per task (textclf/task.py), kept in the repository
so that it loads with no network.

    single_label   accuracy, f1 (macro-F1)
    multi_label    micro_f1, macro_f1, subset_accuracy (every label of the example right)
    regression     mse, pearson, spearman (None where undefined: a constant prediction or target)

`evaluate.load("accuracy")`, `"f1"`, `"mse"`, `"pearsonr"` and `"spearmanr"` fetch their scripts from the
Hugging Face Hub; this computes the same scores (scikit-learn's and SciPy's, as those scripts do) in one pass.
"""

import warnings

import datasets
import evaluate
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, mean_squared_error

FEATURES = {
    "single_label": datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}),
    "multi_label": datasets.Features({"predictions": datasets.List(datasets.Value("int32")),
                                      "references": datasets.List(datasets.Value("int32"))}),
    "regression": datasets.Features({"predictions": datasets.Value("float32"),
                                     "references": datasets.Value("float32")}),
}


class Scores(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="The scores of a task: single_label, multi_label or regression (the config name).",
            citation="",
            inputs_description="predictions and references: class ids (single_label), 0/1 per label (multi_label) "
                               "or numbers (regression); labels: the class ids to average F1 over (default: "
                               "those that occur)",
            features=FEATURES[self.config_name],
        )

    def _compute(self, predictions, references, labels=None):
        if self.config_name == "single_label":
            return {"accuracy": float(accuracy_score(references, predictions)),
                    "f1": float(f1_score(references, predictions, average="macro", labels=labels, zero_division=0))}
        if self.config_name == "multi_label":
            # On 0/1 indicator rows scikit-learn's accuracy is subset accuracy.
            return {"micro_f1": float(f1_score(references, predictions, average="micro", zero_division=0)),
                    "macro_f1": float(f1_score(references, predictions, average="macro", zero_division=0)),
                    "subset_accuracy": float(accuracy_score(references, predictions))}
        return {"mse": float(mean_squared_error(references, predictions)),
                "pearson": correlation(pearsonr, predictions, references),
                "spearman": correlation(spearmanr, predictions, references)}


def correlation(function, predictions, references):
    """None where a correlation is undefined (fewer than two examples, or a constant side), not SciPy's nan."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SciPy warns on constant input; None says it
        value = float(function(predictions, references)[0]) if len(predictions) > 1 else float("nan")
    return None if value != value else value
