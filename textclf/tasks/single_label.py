"""--task single_label, the default: one label per text, a softmax over the labels."""

from collections import Counter

from textclf.errors import InputError

from .task import Task, count_values, is_number, label_table


class SingleLabel(Task):
    """The default kind: one label per text."""

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
