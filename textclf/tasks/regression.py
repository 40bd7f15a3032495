"""--task regression: a number per text, one output."""

import math
from typing import Optional

from textclf.errors import InputError

from .task import Task


class Regression(Task):
    kind = "regression"
    problem_type = "regression"
    scores = [("mse", "MSE", False), ("pearson", "Pearson", True), ("spearman", "Spearman", True)]
    scores_module = "textclf.tasks.scores:RegressionScores"  # the evaluate module that computes them
    picture = "predicted_vs_true.png"
    output = "score"  # the name of the model's one output (its id2label) and of predict's column
    bins = 10  # the most quantile bins of the target that stratify the held-out split
    exact_labels = False  # a number, which a float holds as closely as a reader can

    def label(self, cell, row: str) -> Optional[float]:
        """A finite number."""
        if cell is None:
            return None
        try:
            value = float(cell)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(cell, bool) or not math.isfinite(value):
            raise InputError(f"{row}: label {cell!r} in column '{self.label_column}' is not a finite number, which "
                             "--task regression needs")
        if abs(value) > FLOAT32_MAX:
            raise InputError(f"{row}: label {cell!r} in column '{self.label_column}' is beyond the range of float32 "
                             f"(±{FLOAT32_MAX:.4g}), in which --task regression trains, and would be infinite there; "
                             "scale the labels (e.g. divide them by a power of ten, or take their logarithm)")
        return value

    def label_names(self, labels: list, path: str) -> list[str]:
        return [self.output]

    def labels_scale(self, examples) -> Optional[float]:
        """The largest magnitude of the numbers: the loss is their squared error from outputs that start near 0."""
        return max((abs(float(label)) for label in examples["labels"] if label is not None), default=None)

    def encode_labels(self, labels: list, names: list[str], path: str):
        """The numbers, as floats."""
        from datasets import Value

        return labels, Value("float32")

    def cell(self, label, names: list[str]) -> float:
        """The score as the data wrote it: a float32 label written with the fewest digits that read back as it."""
        import numpy as np

        return float(str(np.float32(label)))

    def strata(self, labels: list, held_out: int, names=None, refusal="cannot hold out") -> tuple:
        """Quantile bins of the target: as many as keep at least 2 examples in each."""
        import numpy as np

        values = np.asarray(labels)
        for bins in range(min(self.bins, held_out), 1, -1):
            edges = np.unique(np.quantile(values, np.linspace(0, 1, bins + 1)[1:-1]))
            strata = np.searchsorted(edges, values, side="right")
            if np.bincount(strata).min() >= 2:
                return strata.tolist(), f"stratified by {len(edges) + 1} quantile bins of the target"
        return None, "not stratified: too few examples to bin the target"

    def predictions(self, logits):
        """The one output."""
        return logits[:, 0].float()

    def predicted(self, logits, names: list[str]) -> list[dict]:
        return [{self.output: float(score)} for score in self.predictions(logits)]

    def shown(self, row: dict) -> str:
        return f"{row[self.output]:.4f}"

    def baseline(self):
        from sklearn.linear_model import Ridge

        return Ridge(), "ridge regression"


# The largest float32, the type labels are trained in: a larger label would be infinite there.
FLOAT32_MAX = 3.4028234663852886e38
