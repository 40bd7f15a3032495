"""A run's labelled examples (textclf/data/examples.py): labels read and encoded exactly (integers past 64 bits, numbers
as text), the held-out split, the evaluated examples written out, the fingerprint."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import OFFLINE, REPO, TINY, assert_refused, read_csv, write_csv
from textclf.data.examples import read_labelled
from textclf.errors import InputError
from textclf.tasks.task import Task


@pytest.fixture(scope="module")
def rows(reviews_csv):
    return [{"label": row["label"], "review": row["review"]} for row in read_csv(reviews_csv)][:40]


def json_lines(rows):
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def write(path, content: bytes):
    path.write_bytes(content)
    return str(path)


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


def test_the_held_out_split_nobody_asked_for_is_capped_and_one_asked_for_is_not(capsys):
    """10%, at most 10,000 examples, said once; a fraction or a number of examples asked for is held out whole.
    The same draw every time: a resume and the report rebuild it."""
    from datasets import Dataset

    from textclf.data.examples import hold_out
    from textclf.tasks.task import Task

    task = Task.of("single_label", "review", "label")
    table = Dataset.from_dict({"text": [f"评论{i}" for i in range(120_000)], "labels": [i % 3 for i in range(120_000)]})
    names = ["a", "b", "c"]
    train, held = hold_out(table, names, "big.csv", task, None, 0)
    assert (len(train), len(held)) == (110_000, 10_000)
    assert sorted(set(held["labels"])) == [0, 1, 2] and held["labels"].count(0) in (3333, 3334)
    assert capsys.readouterr().out == ("eval: 10,000 examples (10%, at most 10,000; --eval_split asks for more) of "
                                       "big.csv held out, stratified by label\n")
    assert hold_out(table, names, "big.csv", task, None, 0)[1]["text"] == held["text"]
    for asked, size in ((0.2, 24_000), (30_000.0, 30_000)):
        assert len(hold_out(table, names, "big.csv", task, asked, 0)[1]) == size
    small = table.select(range(5_000))
    assert len(hold_out(small, names, "small.csv", task, None, 0)[1]) == 500
    capsys.readouterr()
    with pytest.raises(InputError, match="cannot hold out 5,000 examples of small.csv: it has 5,000 examples"):
        hold_out(small, names, "small.csv", task, 5_000.0, 0)


@pytest.mark.parametrize("eval_split, valid", [(0.5, True), (2500, True), (1, True), (0, False), (1.5, False),
                                               (-3, False)])
def test_eval_split_is_a_fraction_or_a_number_of_examples(eval_split, valid):
    from textclf.config import TrainConfig

    if valid:
        assert TrainConfig(eval_split=eval_split).eval_split == eval_split
    else:
        with pytest.raises(InputError, match="eval_split must be a fraction in .0, 1. or a whole number of examples"):
            TrainConfig(eval_split=eval_split)


@pytest.mark.parametrize("kind, columns, rows", [
    ("single_label", ("review", "stars"), [{"review": "好", "stars": 2}, {"review": "差", "stars": 10},
                                           {"review": "还行", "stars": 2}]),
    ("multi_label", ("review", "tags"), [{"review": "好", "tags": ["味道", "服务"]}, {"review": "差", "tags": []},
                                         {"review": "慢", "tags": ["配送"]}]),
    ("regression", ("review", "score"), [{"review": "好", "score": 4.3}, {"review": "差", "score": 1.1}]),
    ("single_label", ("query", "label", "answer"), [{"query": "问", "answer": "答", "label": "yes"},
                                                    {"query": "问2", "answer": "答2", "label": "no"}]),
])
def test_written_examples_are_the_data_s_columns_and_read_back_as_the_same_examples(tmp_path, kind, columns, rows):
    from textclf.data.examples import read_labelled, write_examples
    from textclf.tasks.task import Task

    task = Task.of(kind, *columns)
    source = write(tmp_path / "data.jsonl", json_lines(rows).encode())
    table, names = read_labelled(source, task)
    (tmp_path / "elsewhere").write_text("untouched")
    os.symlink(tmp_path / "elsewhere", tmp_path / "eval.jsonl.tmp")  # a link at the temporary name is not followed
    write_examples(table, task, names, str(tmp_path / "eval.jsonl"))
    assert (tmp_path / "elsewhere").read_text() == "untouched" and not os.path.lexists(tmp_path / "eval.jsonl.tmp")
    written = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [set(row) for row in written] == [set(row) for row in rows]
    assert [row[task.label_column] for row in written] == [
        str(row[task.label_column]) if kind == "single_label" else row[task.label_column] for row in rows]
    again, _ = read_labelled(str(tmp_path / "eval.jsonl"), task, names=names)
    assert again.to_dict() == table.to_dict()


def test_a_text_column_called_text_is_fingerprinted_as_any_other(tmp_path):
    """`datasets` hands a file's own `text` column on as large_string, which Arrow's join did not take."""
    from textclf.data.examples import fingerprint, read_labelled
    from textclf.tasks.task import Task

    rows = "".join(f"{i % 2},评论{i}\n" for i in range(6))
    prints = {column: fingerprint(read_labelled(write(tmp_path / f"{column}.csv", f"stars,{column}\n{rows}".encode()),
                                                Task.of("single_label", column, "stars"))[0])
              for column in ("text", "review")}
    assert prints["text"] == prints["review"]


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
