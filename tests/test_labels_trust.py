"""Labels are read as written or refused in one line (textclf/data/reading.py, textclf/tasks/): an integer past 64
bits in a CSV column is read as the JSON reader reads it, a float, which a class cannot be (the rows are named)
and a regression's number can; a regression label past float32's range is refused. A run that diverges on labels
of a huge scale says so (textclf/loop/divergence.py), and one whose first step diverged does not blame the
learning rate."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator

from conftest import OFFLINE, REPO, TINY, assert_refused, read_csv, train_forked, write_csv
from textclf.data.examples import read_labelled
from textclf.errors import InputError
from textclf.loop.divergence import DivergenceWatch, diverged
from textclf.tasks.task import Task

HUGE = 99999999999999999999  # past 64 bits: 2**64 is 18446744073709551616


def labelled_file(tmp_path, suffix: str, labels: list, **columns) -> str:
    """A file of `labels`, one review each (and any other `columns`), as CSV or JSON Lines."""
    rows = [{"label": label, "review": f"评论{i}", **{name: values[i] for name, values in columns.items()}}
            for i, label in enumerate(labels)]
    path = tmp_path / f"data{suffix}"
    if suffix == ".csv":
        write_csv(path, rows)
    else:
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def refused(path: str, kind: str) -> str:
    with pytest.raises(InputError) as refusal:
        read_labelled(path, Task.of(kind, "review", "label"))
    message = str(refusal.value)
    assert len(message.splitlines()) == 1, message
    return message


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
@pytest.mark.parametrize("kind", ["single_label", "multi_label"])
def test_a_class_that_is_an_integer_past_what_a_reader_holds_exactly_is_refused_naming_its_rows(tmp_path, kind,
                                                                                                 suffix):
    path = labelled_file(tmp_path, suffix, [0, 1, 0, HUGE, 1, -HUGE, 0, 1])
    assert refused(path, kind) == (
        f"{path}: 2 rows (4, 6) have a label in column 'label' that is an integer too large to read exactly (read as "
        "the float 1e+20, -1e+20, which rounds integers past 2**53); correct those rows, or write the labels as names "
        "that are not numbers (e.g. c99999999999999999999)")


def test_a_class_written_as_a_string_of_digits_stays_a_name(tmp_path):
    path = labelled_file(tmp_path, ".jsonl", ["0", "1", str(HUGE), str(HUGE)])
    _, names = read_labelled(path, Task.of("single_label", "review", "label"))
    assert names == ["0", "1", str(HUGE)]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_regression_label_past_64_bits_is_the_number_it_is(tmp_path, suffix):
    """A number per example: the float nearest the integer is that number (as JSON's reader reads it); whether
    training can take its scale is the divergence check's to say."""
    path = labelled_file(tmp_path, suffix, [1, 2, HUGE, 3])
    table, _ = read_labelled(path, Task.of("regression", "review", "label"))
    assert table["labels"][:] == [1.0, 2.0, pytest.approx(1e20), 3.0]


def test_a_column_of_integers_past_64_bits_that_no_task_reads_does_not_stop_the_file(tmp_path):
    path = labelled_file(tmp_path, ".csv", ["a", "b", "a", "b"], id=[1, HUGE, 3, HUGE + 1])
    table, names = read_labelled(path, Task.of("single_label", "review", "label"))
    assert names == ["a", "b"] and len(table) == 4


def test_a_regression_label_past_float32_is_refused_as_it_would_be_infinite_in_training(tmp_path):
    path = labelled_file(tmp_path, ".csv", [1.5, 2.5, 1e39, 3.5])
    message = refused(path, "regression")
    assert message.startswith(f"{path} row 3: label 1e+39 in column 'label' is beyond the range of float32 "
                              "(±3.403e+38), in which --task regression trains, and would be infinite there; "
                              "scale the labels"), message
    table, _ = read_labelled(labelled_file(tmp_path, ".jsonl", [1.5, 3e38]), Task.of("regression", "review", "label"))
    assert all(math.isfinite(label) for label in table["labels"][:])  # within float32: kept


@pytest.mark.slow
def test_train_py_refuses_a_class_past_64_bits_in_one_line(tmp_path, cache_dir):
    """The command's side: exit code 2, one `error:` line, no traceback (before: datasets' OverflowError)."""
    path = labelled_file(tmp_path, ".csv", [0, 1] * 10 + [HUGE])
    result = subprocess.run([sys.executable, "train.py", *TINY, "--data", path, "--cache_dir", str(cache_dir),
                             "--output_dir", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={**os.environ, **OFFLINE})
    assert_refused(result, f"{path}: row 21 has a label in column 'label' that is an integer too large to read "
                           "exactly")
    assert not (tmp_path / "out").exists()


# --- a divergence and its cause ---

def test_the_divergence_line_names_the_labels_scale_where_it_is_huge(tmp_path):
    message = str(diverged("step 1: its loss is not finite (NaN or inf)", str(tmp_path), 5e-5, True,
                           before_any_update=True, labels_scale=4.3e30))
    assert message == (
        "training diverged at step 1: its loss is not finite (NaN or inf); the labels' scale is the likely cause: they "
        "reach 4.3e+30 in magnitude, and the loss is their squared error from outputs that start near 0. Nothing of "
        "it was saved: no checkpoint was saved before it; scale the labels to around 1 (e.g. divide them by 1e+30, "
        "or standardize them), then start a new run")


def test_a_first_step_that_diverged_does_not_blame_the_learning_rate(tmp_path):
    message = str(diverged("step 1: its gradient norm is not finite (NaN or inf)", str(tmp_path), 5e-5, True,
                           before_any_update=True))
    assert message.startswith("training diverged at step 1: its gradient norm is not finite (NaN or inf), before "
                              "any update: the learning rate is not the cause, the data or the initial model is")
    assert "--learning_rate" not in message


@pytest.mark.parametrize("labels_scale", [None, 5.0])
def test_a_later_divergence_with_labels_of_a_usual_scale_still_blames_the_learning_rate(tmp_path, labels_scale):
    message = str(diverged("step 4: its loss is not finite (NaN or inf)", str(tmp_path), 1e30, True,
                           labels_scale=labels_scale))
    assert "the learning rate 1e+30 is likely too high" in message and "labels' scale" not in message


@pytest.mark.parametrize("task, labels, cause", [
    ("regression", [2e30, -4.3e30], "the labels' scale is the likely cause: they reach 4.3e+30 in magnitude"),
    ("regression", [1.5, 4.5], ", before any update: the learning rate is not the cause"),
    ("single_label", ["好", "差"], ", before any update: the learning rate is not the cause"),
])
def test_the_watch_names_the_scale_the_task_gives_the_training_labels(tmp_path, task, labels, cause):
    """train.py gives the watch `task.labels_scale` of the training labels."""
    from textclf.tasks.task import Task

    scale = Task.of(task, "review", "rating").labels_scale({"labels": labels})
    watch = DivergenceWatch(Accelerator(cpu=True), 5e-5, clipping=True, output_dir=str(tmp_path), labels_scale=scale)
    watch.add(1, torch.tensor(math.inf), torch.tensor(math.inf))
    with pytest.raises(InputError, match="^training diverged at step 1: its loss and gradient norm are not finite") \
            as refusal:
        watch.check(1)
    assert cause in str(refusal.value)


@pytest.mark.slow
def test_a_regression_on_labels_of_a_huge_scale_diverges_naming_the_scale(tmp_path, rating_files, cache_dir):
    rows = [{**row, "rating": float(row["rating"]) * 1e30} for row in read_csv(rating_files["train"])]
    data = write_csv(tmp_path / "ratings.csv", rows)
    result = train_forked([*TINY, "--task", "regression", "--label_column", "rating", "--data", data, "--cache_dir",
                           cache_dir, "--output_dir", tmp_path / "out", "--max_steps", 2], config_file=None,
                          check=False)
    scale = max(row["rating"] for row in rows)
    assert_refused(result, "training diverged at step 1: its loss and gradient norm are not finite (NaN or inf); the "
                           f"labels' scale is the likely cause: they reach {scale:.3g} in magnitude")
