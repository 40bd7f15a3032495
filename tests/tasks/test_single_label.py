"""One label per text (textclf/tasks/single_label.py): label cells as users write them, each mistake in one line."""

import re

import pytest

from conftest import SINGLE, splits
from textclf.errors import InputError
from textclf.tasks.task import Task

MIXED = "; clean the column so that every label is a name or every label is an integer, or for a number per " \
        "example use --task regression"


def test_label_cells_are_trimmed_and_none_null_are_class_names(tmp_path):
    rows = "".join(f"{label},评论{i}\n" for i, label in enumerate([" 书籍", "书籍 ", "None", "null", "pos"] * 4))
    train, held_out, names = splits(tmp_path, "d.csv", "label,review\n" + rows)
    assert names == ["None", "null", "pos", "书籍"]
    assert len(train) + len(held_out) == 20


@pytest.mark.parametrize("task", ["single_label", "multi_label", "regression"])
@pytest.mark.parametrize("name, spelled", [("d.csv", ["nan", "NaN", "NA"]), ("d.tsv", ["NA"])])
def test_a_missing_number_spelled_in_a_label_cell_is_refused_not_a_class(tmp_path, task, name, spelled):
    labels = ["1", "0", *spelled, "0", "1", "0", "1"]
    sep = "\t" if name.endswith(".tsv") else ","
    rows = "".join(f"{label}{sep}评论{i}\n" for i, label in enumerate(labels))
    with pytest.raises(InputError) as refused:
        splits(tmp_path, name, f"label{sep}review\n" + rows, task=Task.of(task, "review", "label"))
    rows_named = "row 3 has" if len(spelled) == 1 else "3 rows (3, 4, 5) have"
    shown = ", ".join(map(repr, spelled))
    assert str(refused.value) == (f"{tmp_path / name}: {rows_named} a label spelled as a missing number ({shown}) in "
                                  "column 'label', which pandas and datasets read as NaN; fill them in or remove those "
                                  "rows")


def test_empty_label_cells_are_named_by_row_first_few_and_a_count(tmp_path):
    labels = ["1", "", "0", "", "1", "0", "", " ", "", "", "1", "", "0"]  # empty at rows 2, 4, 7, 8, 9, 10, 12
    rows = "".join(f"{label},评论{i}\n" for i, label in enumerate(labels))
    with pytest.raises(InputError, match=r"d.csv: 7 rows \(2, 4, 7, 8, 9 and 2 more\) have no value in label "
                                         r"column 'label'; fill them in"):
        splits(tmp_path, "d.csv", "label,review\n" + rows)


def test_row_numbers_count_the_rows_dropped_for_empty_text(tmp_path):
    with pytest.raises(InputError, match=r"d.csv: row 3 has no value in label column"):
        splits(tmp_path, "d.csv", "label,review\n1,\n0,好\n,差\n1,棒\n")


@pytest.mark.parametrize("line, where, advice", [
    ('{"review": "好", "label": 1.5}', "row 2: label 1.5 in column 'label' is not a class", "use --task regression"),
    ('{"review": "好", "label": NaN}', "row 2 has a label spelled as a missing number (nan) in column 'label'",
     "fill them in or remove those rows"),
])
def test_float_and_nan_classes_are_refused_with_regression_suggested(tmp_path, line, where, advice):
    with pytest.raises(InputError, match=advice) as refused:
        splits(tmp_path, "d.jsonl", '{"review": "差", "label": 0}\n' + line + "\n",
               eval_text='{"review": "棒", "label": 1}\n')
    assert where in str(refused.value)


def test_integral_floats_are_integer_classes(tmp_path):
    rows = "".join(f'{{"review": "评论{i}", "label": {i % 2}.0}}\n' for i in range(8))
    _, _, names = splits(tmp_path, "d.jsonl", rows)
    assert names == ["0", "1"]


@pytest.mark.parametrize("name, lines, message", [
    ("d.jsonl", ['{"review": "好", "label": 1}', '{"review": "差", "label": "bad"}'],
     "label column 'label' mixes numbers (row 1: 1) and names (row 2: 'bad')" + MIXED),
    ("d.csv", ["label,review", "0,好", "1,差", "bad,棒", "1,烂"],  # a CSV reader gives every cell as a string
     "label column 'label' mixes numbers (row 1: '0', and 2 more) and names (row 3: 'bad')" + MIXED),
    ("d.jsonl", ['{"review": "好", "label": {"a": 1}}', '{"review": "差", "label": {"a": 2}}'],
     "row 1: label {'a': 1} in column 'label' is a dict, not a class; a class is a name or an integer"),
])
def test_mixed_and_dict_labels_are_one_line(tmp_path, name, lines, message):
    with pytest.raises(InputError) as refused:
        splits(tmp_path, name, "\n".join(lines) + "\n")
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_integers_beside_numbers_written_as_text_are_refused_not_sorted_together():
    with pytest.raises(InputError, match=re.escape("mixes integers (row 1: 1) and numbers written as text (row 2: '2')"
                                                   + MIXED)):
        SINGLE.parse_labels([1, "2"], "d.jsonl")  # as a reader that keeps each cell's JSON type gives them


def test_a_class_too_small_to_split_is_named_with_eval_data_suggested(tmp_path):
    rows = "".join(f"{'好坏'[i % 2]},评论{i}\n" for i in range(20)) + "书籍,一本书\n"
    with pytest.raises(InputError, match=r"1 class \('书籍'\) with a single example, and a class needs at least 2.*"
                                         "--eval_data"):
        splits(tmp_path, "d.csv", "label,review\n" + rows)


def test_ten_thousand_classes_of_one_example_are_counted_and_ten_named(tmp_path):
    rows = "".join(f"c{i},评论{i}\n" for i in range(10_000))
    with pytest.raises(InputError) as refused:
        splits(tmp_path, "d.csv", "label,review\n" + rows)
    assert "10000 classes ('c0', 'c1', 'c10', 'c100', 'c1000', 'c1001', 'c1002', 'c1003', 'c1004', 'c1005' and 9990 " \
           "more) with a single example" in str(refused.value)
    assert len(str(refused.value)) < 400
