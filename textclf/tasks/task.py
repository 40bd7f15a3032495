"""What a task is: one class per kind (--task; --text_pair_column makes pairs of any), which owns its labels, its head
(`problem_type`: the model computes the loss itself, as under the Trainer, and `pipeline` applies softmax, sigmoid or
none), predictions, scores and their direction, baseline and report (docs/tasks.md adds one). Here what every kind
shares, the default kind (SingleLabel, which multi_label's per-label tables reuse) and the registry of kinds, KINDS,
which the command lines read; nothing heavy is imported at the top.
"""

import importlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar, Optional

from textclf.errors import InputError

# Words that make a key a --metric added lower-is-better (greater_is_better); any other key is better higher.
LOWER_IS_BETTER = ("loss", "error", "mse", "mae", "rmse", "wer", "cer", "perplexity", "distance")

# The spellings of a missing number that pandas reads as NaN by default, which this project's readers keep as text
# (load_table); lower case. `None` and `null` stay names: a class of that name is common.
NAN_SPELLINGS = {"nan", "-nan", "na", "<na>", "n/a", "#n/a", "#na"}


@dataclass(frozen=True)
class Task:
    """What every kind shares. A kind (a subclass, registered in KINDS) sets the class attributes below (its scores
    computed by the evaluate module scores_module names) and defines label, label_names, encode_labels, cell, strata,
    predictions, predicted, shown and baseline (see SingleLabel's); it may change check_labels, targets and
    figures."""

    text_column: str
    label_column: str
    text_pair_column: Optional[str] = None
    label_separator: str = ","
    threshold: float = 0.5

    kind: ClassVar[str]  # the --task name
    problem_type: ClassVar[str]  # transformers' name: picks the model's loss and the pipeline's function
    scores: ClassVar[list[tuple[str, str, bool]]]  # key (logged as eval_<key>), title, whether higher is better
    scores_module: ClassVar[str]  # "module:Class", the evaluate module that computes them (scores.py has the kinds')
    fewest_labels: ClassVar[int] = 1  # the smallest head (for the check, which reads no data)
    exact_labels: ClassVar[bool] = True  # a label is a name or an integer, which a rounded float is not
    picture: ClassVar[Optional[str]] = None  # the file report draws (report.DRAWINGS)

    def __post_init__(self):
        if type(self) is Task:  # Task("single_label", ...) would take the kind for the text column
            raise TypeError("Task is what the kinds share: make one with Task.of(kind, ...) or a kind's class")

    @staticmethod
    def of(kind: str, *columns, **options) -> "Task":
        """`Task.of("regression", "review", "stars")`."""
        return KINDS[kind].load()(*columns, **options)

    @classmethod
    def from_config(cls, cfg) -> "Task":
        """The task of a TrainConfig, or of anything with its task fields."""
        return cls.of(cfg.task, cfg.text_column, cfg.label_column, cfg.text_pair_column, cfg.label_separator,
                      cfg.threshold)

    @property
    def text_columns(self) -> dict[str, str]:
        """The file's text columns by the tokenizer's names for them: tokenized as `tokenizer(text, text_pair)`,
        a pair's length is what length grouping sees."""
        return {"text": self.text_column, **({"text_pair": self.text_pair_column} if self.text_pair_column else {})}

    def parse_labels(self, cells: list, path: str, rows: Optional[list[int]] = None) -> list:
        """The label column's cells as this kind reads them (`label`); `rows`: their row numbers in the file, for
        the errors."""
        rows = rows or list(range(1, len(cells) + 1))
        if self.exact_labels:
            self.refuse_rounded(cells, rows, path)
        parsed, not_a_number = [], {}
        for row, cell in zip(rows, cells):
            if isinstance(cell, str):
                cell = cell.replace("\ufeff", "").strip() or None  # `书籍 ` is `书籍`; only an empty cell is missing
            if isinstance(cell, str) and cell.lower() in NAN_SPELLINGS or isinstance(cell, float) and math.isnan(cell):
                not_a_number[row] = cell
                continue
            parsed.append(self.label(cell, f"{path} row {row}"))
        if not_a_number:
            spelled = ", ".join(repr(cell) for cell in dict.fromkeys(not_a_number.values()))
            raise InputError(f"{path}: {count_rows(list(not_a_number))} a label spelled as a missing number "
                             f"({spelled}) in column '{self.label_column}', which pandas and datasets read as NaN; "
                             "fill them in or remove those rows")
        self.check_labels(parsed, rows, path)
        return parsed

    def refuse_rounded(self, cells: list, rows: list[int], path: str) -> None:
        """Refuse integers read as the nearest float, which may not be the integer written: a reader holds one past
        64 bits (a column of them, even) as a float, and from 2**53 on a float is a rounded integer."""
        rounded = {row: values for row, cell in zip(rows, cells)
                   if (values := [value for value in (cell if isinstance(cell, list) else [cell])
                                  if is_rounded(value)])}
        if rounded:
            read_as = ", ".join(dict.fromkeys(f"{value:.17g}" for values in rounded.values() for value in values))
            raise InputError(f"{path}: {count_rows(list(rounded))} a label in column '{self.label_column}' that is "
                             f"an integer too large to read exactly (read as the float {read_as}, which rounds "
                             "integers past 2**53); correct those rows, or write the labels as names that are not "
                             "numbers (e.g. c99999999999999999999)")

    def check_labels(self, labels: list, rows: list[int], path: str) -> None:
        """What the column as a whole must satisfy."""
        missing = [row for row, label in zip(rows, labels) if label is None]
        if missing:
            raise InputError(f"{path}: {count_rows(missing)} no value in label column '{self.label_column}'; "
                             "fill them in or remove those rows")

    def labels_scale(self, examples) -> Optional[float]:
        """The largest magnitude of the labels of `examples` (a table with a `labels` column) where it bears on
        training, a number per example's; None for classes, whose labels are names: their column is not read."""
        return None

    def check_known(self, seen: set, names: list[str], path: str) -> dict[str, int]:
        """Each label name's id, once every name seen is one the training data has."""
        unseen = sorted(seen - set(names))
        if unseen:
            raise InputError(f"{path} has {count_values(unseen, 'label')} not seen in the training data "
                             f"(known: {count_values(names, 'label')})")
        return {name: i for i, name in enumerate(names)}

    def head_config(self, label_names: list[str]) -> dict:
        """What the model's config takes for this task's head."""
        return dict(num_labels=len(label_names), id2label=dict(enumerate(label_names)),
                    label2id={name: i for i, name in enumerate(label_names)}, problem_type=self.problem_type)

    def targets(self, labels):
        """A batch's `labels` as the scores take them."""
        return labels

    def greater_is_better(self, metric: str) -> bool:
        """Whether a higher `metric` (eval_<key> or <key>) is better: which checkpoint is the best. A key --metric
        added is better higher unless its name says it is an error or a loss (LOWER_IS_BETTER)."""
        key = metric.removeprefix("eval_")
        own = {key: higher for key, _, higher in self.scores}
        return own[key] if key in own else not any(word in key.lower() for word in LOWER_IS_BETTER)

    def evaluation_module(self):
        """A fresh instance of the evaluate module that computes this kind's scores (scores_module), kept in memory."""
        from . import scores  # evaluate, heavy: imported where scores are computed, not with the kinds

        module, _, name = self.scores_module.partition(":")
        return scores.kept_in_memory(getattr(importlib.import_module(module), name))

    def compute_scores(self, predictions: list, references: list, names: Optional[list[str]] = None) -> dict:
        """The scores by key of `predictions` against `references` (what `predictions` and `targets` give), by the
        kind's evaluate module; `names`: every label the model has, which an average over labels takes (the report),
        else those that occur."""
        module = self.evaluation_module()
        module.add_batch(predictions=predictions, references=references)
        return module.compute(names=names)

    def scores_with(self, added: list):
        """What a run's evaluation feeds and computes (scores.Scores): this kind's module and those of the --metric
        modules `added` (find_metrics' FoundMetric, read here from their files)."""
        from . import scores

        return scores.Scores(self.evaluation_module(), [(found.name, scores.load_metric(found)) for found in added])

    @staticmethod
    def find_metrics(names: list[str]) -> list:
        """The --metric modules `names`, found (scores.find_metric): where they are cached or given, or fetched once
        online. One process does it, and the others read the files it found."""
        if not names:
            return []
        from . import scores

        return [scores.find_metric(name) for name in dict.fromkeys(names)]

    def summary(self, scores: dict, prefix: str = "eval_", separator: str = ", ") -> str:
        """'accuracy 0.8180, macro-F1 0.8170': the scores by title (n/a: undefined, e.g. a constant prediction)."""
        return separator.join(f"{title} {format_score(scores[prefix + key])}" for key, title, _ in self.scores)

    def prediction_rows(self, texts: list[str], pairs: Optional[list[str]], logits, names: list[str]) -> list[dict]:
        """One row per example: its text(s), then what the kind predicts."""
        rows = [{"text": text} if pairs is None else {"text": text, "text_pair": pair}
                for text, pair in zip(texts, pairs or texts)]
        return [{**row, **fields} for row, fields in zip(rows, self.predicted(logits, names))]

    def terminal_line(self, row: dict) -> str:
        """A prediction row as one line: the prediction, then the text (and its pair)."""
        return "\t".join([self.shown(row), *(row[column] for column in ("text", "text_pair") if column in row)])

    def figures(self, references: list, predictions: list, names: list[str]) -> dict:
        """What the report adds to the scores (report.json), beside its `picture`."""
        return {}


class SingleLabel(Task):
    """--task single_label, the default: one label per text, a softmax over the labels."""

    kind = "single_label"
    problem_type = "single_label_classification"
    scores = [("accuracy", "accuracy", True), ("f1", "macro-F1", True)]
    scores_module = "textclf.tasks.scores:SingleLabelScores"  # the evaluate module that computes them
    fewest_labels = 2
    picture = "confusion_matrix.png"

    def label(self, cell, row: str):
        """One cell's label, None where missing; `row` ('<file> row <N>') begins the error of a cell that is not
        one. Here a class: a name or an integer."""
        where = f"{row}: label {cell!r} in column '{self.label_column}'"
        if isinstance(cell, bool):  # true/false cells: two names
            return str(cell)
        if isinstance(cell, float) and cell.is_integer():  # 1.0 is class 1 (a JSON writer's integers)
            return int(cell)
        if cell is None or isinstance(cell, (str, int)):
            return cell
        if isinstance(cell, float):
            raise InputError(f"{where} is not a class (classes are names or integers); for a number per example "
                             "use --task regression")
        if isinstance(cell, list):
            raise InputError(f"{where} is a list; a label set per example is --task multi_label")
        raise InputError(f"{where} is a {type(cell).__name__}, not a class; a class is a name or an integer")

    def check_labels(self, labels: list, rows: list[int], path: str) -> None:
        """No missing label, and numbers or names, not both: a CSV reader gives `0`, `1`, `bad` as three
        strings, a JSON reader 1 and "bad" as an integer and a string."""
        super().check_labels(labels, rows, path)
        numbers = [(row, label) for row, label in zip(rows, labels) if is_number(label)]
        names = [(row, label) for row, label in zip(rows, labels) if not is_number(label)]
        if numbers and names:
            raise self.mixed(path, "numbers", numbers, "names", names)
        integers = [(row, label) for row, label in numbers if isinstance(label, int)]
        if 0 < len(integers) < len(numbers):  # 1 and "2" (JSON): numbers both, but with no order between them
            raise self.mixed(path, "integers", integers, "numbers written as text",
                             [(row, label) for row, label in numbers if isinstance(label, str)])

    def mixed(self, path: str, kind: str, cells: list, other_kind: str, other_cells: list) -> InputError:
        """The refusal of a label column that mixes two kinds of label, each as its [(row, label), ...]."""

        def first(kind, cells):
            (row, label), more = cells[0], len(cells) - 1
            return f"{kind} (row {row}: {label!r}" + (f", and {more} more)" if more else ")")

        return InputError(f"{path}: label column '{self.label_column}' mixes {first(kind, cells)} and "
                          f"{first(other_kind, other_cells)}; clean the column so that every label is a name or every "
                          "label is an integer, or for a number per example use --task regression")

    def label_names(self, labels: list, path: str) -> list[str]:
        """The model's outputs in id order (its id2label): here the labels sorted (numerically for integers)."""
        names = [str(label) for label in sorted(set(labels))]
        if len(names) < 2:
            raise InputError(f"{path} has a single label ({names[0]}); a classifier needs at least two")
        return names

    def encode_labels(self, labels: list, names: list[str], path: str):
        """(the `labels` column the model's loss takes, its `datasets` feature): here class ids."""
        from datasets import ClassLabel

        label_id = self.check_known({str(label) for label in labels}, names, path)
        return [label_id[str(label)] for label in labels], ClassLabel(names=names)

    def cell(self, label, names: list[str]):
        """An encoded label as a file writes it, which encode_labels reads back: here the class's name."""
        return names[label]

    def strata(self, labels: list, held_out: int, names=None, refusal="cannot hold out") -> tuple:
        """(what the held-out split is stratified by, one value per example or None for a random split, how to say
        so); `refusal` begins the error when it cannot be. Here the labels: each class needs an example on each
        side."""
        counts = Counter(labels)
        scarce = [str(names[label] if names else label) for label in sorted(counts) if counts[label] < 2]
        if scarce:
            raise InputError(f"{refusal} stratified by label: {count_values(scarce, 'class', 'classes')} with a single "
                             "example, and a class needs at least 2, one on each side; add examples, or give a "
                             "held-out file with --eval_data")
        return labels, "stratified by label"

    def predictions(self, logits):
        """Logits (a tensor, examples x outputs) to what the scores take: here the likeliest label's id."""
        return logits.argmax(dim=-1)

    def predicted(self, logits, names: list[str]) -> list[dict]:
        """Each example's prediction as predict writes it: here the label's id and name, and a softmax
        probability per label."""
        return [{"label": int(p.argmax()), "label_name": names[int(p.argmax())],
                 **{f"prob_{name}": float(value) for name, value in zip(names, p)}} for p in logits.float().softmax(-1)]

    def shown(self, row: dict) -> str:
        """A prediction as predict prints it, before the text."""
        return f"{row['label_name']}\t{row['prob_' + row['label_name']]:.4f}"

    def baseline(self):
        """(the scikit-learn model the report fits on TF-IDF features, what to call it)."""
        from sklearn.linear_model import LogisticRegression

        # saga: on these sparse, wide features it fits several times faster than lbfgs (the default; figures in
        # docs/after-training.md); 1000 iterations, because at 100 it stopped short of converging on small data;
        # saga shuffles, so it is seeded.
        return LogisticRegression(solver="saga", max_iter=1000, random_state=0), "logistic regression"

    def figures(self, references: list, predictions: list, names: list[str]) -> dict:
        """The per-class table and the confusion matrix (rows: true label, columns: predicted label)."""
        from sklearn.metrics import confusion_matrix

        matrix = confusion_matrix(references, predictions, labels=list(range(len(names))))
        return {"per_class": label_table(references, predictions, names), "labels": names,
                "confusion_matrix": matrix.tolist()}


@dataclass(frozen=True)
class Kind:
    """A kind as the command line knows it before any data is read; its class is imported when a run asks for it."""

    about: str  # what --help says of it
    main_metric: str  # the default metric_for_best_model: one of the class's scores
    module: str  # where the class is
    class_name: str

    def load(self) -> type[Task]:
        return getattr(importlib.import_module(self.module), self.class_name)


# The kinds by their --task name (each class's `kind`); the first is the default.
KINDS = {
    "single_label": Kind("one label per text (softmax over the labels)", "eval_f1", "textclf.tasks.task",
                         "SingleLabel"),
    "multi_label": Kind("a set of labels per text (a sigmoid per label, those above --threshold)", "eval_micro_f1",
                        "textclf.tasks.multi_label", "MultiLabel"),
    "regression": Kind("a number per text (one output, the raw score)", "eval_mse", "textclf.tasks.regression",
                       "Regression"),
}


def label_table(references: list, predictions: list, names: list[str]) -> dict:
    """Precision, recall, F1 and support per label (ids, or 0/1 rows), by name."""
    from sklearn.metrics import classification_report

    table = classification_report(references, predictions, labels=list(range(len(names))), target_names=names,
                                  output_dict=True, zero_division=0)
    return {name: {"precision": table[name]["precision"], "recall": table[name]["recall"],
                   "f1": table[name]["f1-score"], "support": int(table[name]["support"])} for name in names}


def count_rows(rows: list[int], shown: int = 5) -> str:
    """'rows 3, 8 and 2 more have': the first few row numbers of a list, and how many there are."""
    listed = ", ".join(map(str, rows[:shown])) + (f" and {len(rows) - shown} more" if len(rows) > shown else "")
    return f"row {listed} has" if len(rows) == 1 else f"{len(rows)} rows ({listed}) have"


def count_values(values: list, noun: str, plural: Optional[str] = None, shown: int = 10) -> str:
    """"3 classes ('a', 'b', 'c')": how many values, and the first `shown` of them."""
    listed = ", ".join(map(repr, values[:shown])) + (f" and {len(values) - shown} more" if len(values) > shown else "")
    return f"{len(values)} {noun if len(values) == 1 else plural or noun + 's'} ({listed})"


def is_number(label) -> bool:
    """Whether a label is a number, or a string that reads as one."""
    if isinstance(label, str):
        try:
            float(label)
        except ValueError:
            return False
    return isinstance(label, (str, int))


def is_rounded(value) -> bool:
    """Whether a label is a float that holds an integer too large for a float to hold exactly."""
    return isinstance(value, float) and value.is_integer() and abs(value) >= 2 ** 53


def format_score(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.4f}"
