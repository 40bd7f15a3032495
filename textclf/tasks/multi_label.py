"""--task multi_label: a set of labels per text, a sigmoid per label."""

import json
from collections import Counter

from textclf.errors import InputError

from .task import SingleLabel, Task, label_table


class MultiLabel(Task):
    kind = "multi_label"
    problem_type = "multi_label_classification"
    scores = [("micro_f1", "micro-F1", True), ("macro_f1", "macro-F1", True),
              ("subset_accuracy", "subset accuracy", True)]
    scores_module = "textclf.tasks.scores:MultiLabelScores"  # the evaluate module that computes them

    def label(self, cell, row: str) -> list[str]:
        """A JSON list of names, or names joined by the separator (a CSV cell); empty or missing: no label, []."""
        where = f"{row}: label cell {cell!r}"
        if isinstance(cell, str) and cell.startswith("["):
            try:
                cell = json.loads(cell)
            except json.JSONDecodeError as e:
                raise InputError(f"{where} does not parse as a JSON list ({e.msg}); write a JSON list of names, "
                                 f"or names separated by '{self.label_separator}' (--label_separator)") from None
        names = cell.split(self.label_separator) if isinstance(cell, str) else [] if cell is None else cell
        if isinstance(names, int) and not isinstance(names, bool):
            names = [names]
        if not isinstance(names, list) or any(isinstance(name, bool) or not isinstance(name, (str, int))
                                              for name in names):
            raise InputError(f"{where} is not a list of label names (strings or integers), nor names separated by "
                             f"'{self.label_separator}'")
        return sorted({str(name).strip() for name in names} - {""})

    def label_names(self, labels: list, path: str) -> list[str]:
        """Every name of every set, sorted."""
        names = sorted({name for names in labels for name in names})
        if not names:
            raise InputError(f"{path} has no label in any row of column '{self.label_column}'")
        return names

    def encode_labels(self, labels: list, names: list[str], path: str):
        """Multi-hot floats (the loss is binary cross-entropy per label)."""
        from datasets import List, Value

        self.check_known({name for names in labels for name in names}, names, path)
        hot = [[float(name in chosen) for name in names] for chosen in map(set, labels)]
        return hot, List(Value("float32"), length=len(names))

    def cell(self, label, names: list[str]) -> list[str]:
        """The names of the set."""
        return [name for name, hot in zip(names, label) if hot]

    def strata(self, labels: list, held_out: int, names=None, refusal="cannot hold out") -> tuple:
        """The label sets, where each occurs at least twice and they are fewer than the held-out examples."""
        sets = [" ".join(str(i) for i, hot in enumerate(row) if hot) for row in labels]
        counts = Counter(sets)
        once = sum(count == 1 for count in counts.values())
        if once:
            return None, f"not stratified: {once} of its {len(counts)} label sets occur only once"
        if len(counts) > held_out:
            return None, f"not stratified: {len(counts)} label sets, more than the {held_out} held-out examples"
        return sets, f"stratified by label set ({len(counts)} sets)"

    def predictions(self, logits):
        """0/1 per label: its sigmoid above the threshold."""
        return (logits.float().sigmoid() > self.threshold).long()

    def targets(self, labels):
        return labels.long()  # the multi-hot floats as 0/1

    def predicted(self, logits, names: list[str]) -> list[dict]:
        """`label_names` (those above the threshold) and `prob_<name>` per label (sigmoid)."""
        return [{"label_names": [name for name, hot in zip(names, chosen) if hot],
                 **{f"prob_{name}": float(value) for name, value in zip(names, p)}}
                for chosen, p in zip(self.predictions(logits).tolist(), logits.float().sigmoid())]

    def shown(self, row: dict) -> str:
        return self.label_separator.join(row["label_names"]) or f"(no label above {self.threshold})"

    def baseline(self):
        from sklearn.multiclass import OneVsRestClassifier

        classifier, _ = SingleLabel.baseline(self)
        return OneVsRestClassifier(classifier), "one-vs-rest logistic regression"

    def figures(self, references: list, predictions: list, names: list[str]) -> dict:
        """The per-label table."""
        return {"per_label": label_table(references, predictions, names), "labels": names}
