"""What a task is, in one place: data, metrics, predict, report, export, rotation and check ask it.

    --task single_label   one label per example (the default): softmax, the likeliest label;
                          accuracy and macro-F1
    --task multi_label    a set of labels per example: a sigmoid per label, those above --threshold;
                          micro-F1, macro-F1 and subset accuracy
    --task regression     a number per example: the model's raw score; MSE, Pearson and Spearman
    --text_pair_column    with any of the three: two texts per example, tokenized as a pair

The model's config records the task (`problem_type`, `id2label`), so that the model computes the
right loss itself (as under the Trainer) and `pipeline("text-classification")` applies the right
function to its outputs: softmax, sigmoid, or none.
"""

import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .config import KINDS  # noqa: F401  (the kinds of task, where the command lines read them early)
from .errors import InputError

PROBLEM_TYPES = {"single_label": "single_label_classification", "multi_label": "multi_label_classification",
                 "regression": "regression"}
# Each kind's scores in the order they are printed: key (logged as eval_<key>), title, whether higher is better.
METRICS = {
    "single_label": [("accuracy", "accuracy", True), ("f1", "macro-F1", True)],
    "multi_label": [("micro_f1", "micro-F1", True), ("macro_f1", "macro-F1", True),
                    ("subset_accuracy", "subset accuracy", True)],
    "regression": [("mse", "MSE", False), ("pearson", "Pearson", True), ("spearman", "Spearman", True)],
}
MAIN_METRIC = {"single_label": "eval_f1", "multi_label": "eval_micro_f1", "regression": "eval_mse"}
SCORE = "score"  # the name of a regression model's one output (its id2label)
QUANTILE_BINS = 10  # strata of a regression target for the held-out split


@dataclass(frozen=True)
class Task:
    kind: str  # one of KINDS
    text_column: str
    label_column: str
    text_pair_column: Optional[str] = None
    label_separator: str = ","
    threshold: float = 0.5

    @classmethod
    def from_config(cls, cfg) -> "Task":
        """The task of a training config (TrainConfig, or anything with its task fields)."""
        return cls(cfg.task, cfg.text_column, cfg.label_column, cfg.text_pair_column, cfg.label_separator,
                   cfg.threshold)

    # --- the examples ----------------------------------------------------------------------------------

    @property
    def text_columns(self) -> dict[str, str]:
        """The file's text columns by the name the tokenizer takes them under: `text`, and `text_pair` for pairs
        (tokenized as `tokenizer(text, text_pair)`, so the pair's length is what length grouping sees)."""
        return {"text": self.text_column, **({"text_pair": self.text_pair_column} if self.text_pair_column else {})}

    # --- labels ----------------------------------------------------------------------------------------

    def parse_labels(self, cells: list, path: str, rows: Optional[list[int]] = None) -> list:
        """The label column's cells as this task reads them: classes (names or integers), lists of label names,
        or numbers. Names are trimmed; only an empty cell is missing. `rows` are the cells' row numbers in the
        file (default 1, 2, ...), for the errors."""
        rows = rows or list(range(1, len(cells) + 1))
        parsed = []
        for row, cell in zip(rows, cells):
            if isinstance(cell, str):
                cell = cell.replace("\ufeff", "").strip() or None  # `书籍 ` is `书籍`; only an empty cell is missing
            if self.kind == "single_label":
                parsed.append(self._class(cell, path, row))
            elif self.kind == "multi_label":
                parsed.append(self._label_set(cell, path, row))
            else:
                parsed.append(self._number(cell, path, row))
        if self.kind != "multi_label":  # an empty multi-label cell is an empty set
            missing = [row for row, label in zip(rows, parsed) if label is None]
            if missing:
                raise InputError(f"{path}: {count_rows(missing)} no value in label column '{self.label_column}'; "
                                 "fill them in or remove those rows")
        if self.kind == "single_label":
            first = {}  # the first row of each kind of class
            for row, label in zip(rows, parsed):
                first.setdefault(type(label), (row, label))
            if len(first) > 1:
                (int_row, number), (str_row, name) = first[int], first[str]
                raise InputError(f"{path}: label column '{self.label_column}' mixes integers (row {int_row}: "
                                 f"{number}) and names (row {str_row}: {name!r}); write every label as a name, or "
                                 "every label as an integer")
        return parsed

    def _class(self, cell, path: str, row: int):
        """A single-label class: a name (str) or an integer; None when missing."""
        where = f"{path} row {row}: label {cell!r} in column '{self.label_column}'"
        if cell is None or isinstance(cell, str):
            return cell
        if isinstance(cell, bool):  # true/false cells: two names
            return str(cell)
        if isinstance(cell, int):
            return cell
        if isinstance(cell, float):
            if cell.is_integer():  # 1.0 is class 1 (a JSON writer's integers)
                return int(cell)
            raise InputError(f"{where} is not a class (classes are names or integers); for a number per example "
                             "use --task regression")
        if isinstance(cell, list):
            raise InputError(f"{where} is a list; a label set per example is --task multi_label")
        raise InputError(f"{where} is a {type(cell).__name__}, not a class; a class is a name or an integer")

    def _label_set(self, cell, path: str, row: int) -> list[str]:
        """A JSON list of names, or names joined by the separator (a CSV cell); empty or missing: no label."""
        where = f"{path} row {row}: label cell {cell!r}"
        if isinstance(cell, str) and cell.strip().startswith("["):
            try:
                cell = json.loads(cell)
            except json.JSONDecodeError as e:
                raise InputError(f"{where} does not parse as a JSON list ({e.msg}); write a JSON list of names, "
                                 f"or names separated by '{self.label_separator}' (--label_separator)") from None
        if cell is None:
            return []
        if isinstance(cell, str):
            names = cell.split(self.label_separator)
        elif isinstance(cell, list):
            names = cell
        elif isinstance(cell, int) and not isinstance(cell, bool):
            names = [cell]
        else:
            raise InputError(f"{where} is not a list of label names (expected a list, or names separated by "
                             f"'{self.label_separator}')")
        if not all(isinstance(name, str) or (isinstance(name, int) and not isinstance(name, bool)) for name in names):
            raise InputError(f"{where} holds something other than label names (strings or integers)")
        return sorted({str(name).strip() for name in names} - {""})

    def _number(self, cell, path: str, row: int) -> Optional[float]:
        if cell is None:  # an empty cell (a blank string was made None by parse_labels)
            return None
        try:
            value = float(cell)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(cell, bool) or not math.isfinite(value):
            raise InputError(f"{path} row {row}: label {cell!r} in column '{self.label_column}' is not a finite "
                             "number, which --task regression needs")
        return value

    def label_names(self, labels: list, path: str) -> list[str]:
        """The model's outputs in id order: the labels sorted (numerically for integer labels), or SCORE."""
        if self.kind == "regression":
            return [SCORE]
        if self.kind == "multi_label":
            names = sorted({name for names in labels for name in names})
            if not names:
                raise InputError(f"{path} has no label in any row of column '{self.label_column}'")
            return names
        names = [str(label) for label in sorted(set(labels))]
        if len(names) < 2:
            raise InputError(f"{path} has a single label ({names[0]}); a classifier needs at least two")
        return names

    def encode_labels(self, labels: list, names: list[str], path: str):
        """(the `labels` column the model's loss takes, its feature): class ids, multi-hot floats, or floats."""
        from datasets import ClassLabel, List, Value  # here: the command line reads this module before `datasets`

        if self.kind == "regression":
            return labels, Value("float32")
        seen = {str(label) for label in labels} if self.kind == "single_label" else {n for ns in labels for n in ns}
        unseen = sorted(seen - set(names))
        if unseen:
            raise InputError(f"{path} has label(s) {', '.join(unseen)} not seen in the training data "
                             f"(known: {', '.join(names)})")
        label_id = {name: i for i, name in enumerate(names)}
        if self.kind == "single_label":
            return [label_id[str(label)] for label in labels], ClassLabel(names=names)
        hot = np.zeros((len(labels), len(names)), dtype=np.float32)
        for row, row_names in enumerate(labels):
            hot[row, [label_id[name] for name in row_names]] = 1
        return hot.tolist(), List(Value("float32"), length=len(names))

    @property
    def problem_type(self) -> str:
        """transformers' name for the task, set on the model's config: it picks the loss and the pipeline's function."""
        return PROBLEM_TYPES[self.kind]

    @property
    def fewest_labels(self) -> int:
        """The smallest head a model of this task has (for the check, which reads no data)."""
        return 2 if self.kind == "single_label" else 1

    def strata(self, labels: list, held_out: int) -> tuple[Optional[list], str]:
        """What the held-out split is stratified by (one value per example; None: a random split), and how to
        say so. `labels` are the encoded ones; `held_out` is the number of examples the split holds out."""
        if self.kind == "single_label":
            return labels, "stratified by label"
        if self.kind == "multi_label":
            sets = [" ".join(str(i) for i, hot in enumerate(row) if hot) for row in labels]
            counts = Counter(sets)
            once = sum(count == 1 for count in counts.values())
            if once:
                return None, f"not stratified: {once} of its {len(counts)} label sets occur only once"
            if len(counts) > held_out:
                return None, f"not stratified: {len(counts)} label sets, more than the {held_out} held-out examples"
            return sets, f"stratified by label set ({len(counts)} sets)"
        values = np.asarray(labels)
        for bins in range(min(QUANTILE_BINS, held_out), 1, -1):
            edges = np.unique(np.quantile(values, np.linspace(0, 1, bins + 1)[1:-1]))
            strata = np.searchsorted(edges, values, side="right")
            if np.bincount(strata).min() >= 2:
                return strata.tolist(), f"stratified by {len(edges) + 1} quantile bins of the target"
        return None, "not stratified: too few examples to bin the target"

    # --- outputs and scores ------------------------------------------------------------------------------

    def predictions(self, logits):
        """Logits (a tensor, examples x outputs) to predictions: label ids, 0/1 per label, or scores."""
        if self.kind == "single_label":
            return logits.argmax(dim=-1)
        if self.kind == "multi_label":
            return (logits.float().sigmoid() > self.threshold).long()
        return logits[:, 0].float()

    def targets(self, labels):
        """A batch's `labels` as the scores take them: ids, 0/1 per label (the multi-hot floats), or scores."""
        return labels.long() if self.kind == "multi_label" else labels

    @property
    def metrics(self) -> list[str]:
        """The keys of this task's scores, as logged (eval_<key>)."""
        return [f"eval_{key}" for key, _, _ in METRICS[self.kind]]

    def greater_is_better(self, metric: str) -> bool:
        """Whether a higher value of `metric` (eval_<key> or <key>) is better: which checkpoint is the best."""
        directions = {key: higher for key, _, higher in METRICS[self.kind]}
        return directions[metric.removeprefix("eval_")]

    def summary(self, scores: dict, prefix: str = "eval_", separator: str = ", ") -> str:
        """'accuracy 0.8180, macro-F1 0.8170': the scores by title (n/a: undefined, e.g. a constant prediction)."""
        return separator.join(f"{title} {format_score(scores[prefix + key])}" for key, title, _ in METRICS[self.kind])

    def prediction_rows(self, texts: list[str], pairs: Optional[list[str]], logits, names: list[str]) -> list[dict]:
        """One row per example: its text(s), then the label id, name and a probability per label (single_label);
        the names above the threshold and a sigmoid per label (multi_label); or the score (regression)."""
        rows = [{"text": text} for text in texts]
        if pairs is not None:
            for row, pair in zip(rows, pairs):
                row["text_pair"] = pair
        if self.kind == "regression":
            return [{**row, SCORE: float(score)} for row, score in zip(rows, self.predictions(logits))]
        if self.kind == "single_label":
            probabilities = logits.float().softmax(dim=-1)
            predicted = [{"label": int(p.argmax()), "label_name": names[int(p.argmax())]} for p in probabilities]
        else:
            probabilities = logits.float().sigmoid()
            predicted = [{"label_names": [name for name, hot in zip(names, row) if hot]}
                         for row in self.predictions(logits).tolist()]
        return [{**row, **chosen, **{f"prob_{name}": float(value) for name, value in zip(names, p)}}
                for row, chosen, p in zip(rows, predicted, probabilities)]

    def terminal_line(self, row: dict) -> str:
        """A prediction row as one line: the label name and its probability, the names, or the score; then
        the text (and its pair)."""
        texts = "\t".join(row[column] for column in ("text", "text_pair") if column in row)
        if self.kind == "single_label":
            return f"{row['label_name']}\t{row['prob_' + row['label_name']]:.4f}\t{texts}"
        if self.kind == "multi_label":
            names = self.label_separator.join(row["label_names"]) or f"(no label above {self.threshold})"
            return f"{names}\t{texts}"
        return f"{row[SCORE]:.4f}\t{texts}"


def count_rows(rows: list[int], shown: int = 5) -> str:
    """'rows 3, 8 and 2 more have': the first few row numbers of a list, and how many there are."""
    listed = ", ".join(map(str, rows[:shown])) + (f" and {len(rows) - shown} more" if len(rows) > shown else "")
    return f"row {listed} has" if len(rows) == 1 else f"{len(rows)} rows ({listed}) have"


def format_score(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.4f}"
