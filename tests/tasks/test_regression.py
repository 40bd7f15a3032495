"""A score per text (textclf/tasks/regression.py): labels read as numbers."""

import pytest

from conftest import splits
from textclf.errors import InputError
from textclf.tasks.task import Task


def test_an_integer_column_with_empty_cells_reports_them_and_regression_reads_the_rest(tmp_path):
    rows = "label,review\n" + "".join(f"{i % 3},评论{i}\n" for i in range(12)) + ",空\n"
    with pytest.raises(InputError, match="row 13 has no value in label column"):
        splits(tmp_path, "d.csv", rows)
    with pytest.raises(InputError, match="row 13 has no value in label column"):
        splits(tmp_path, "r.csv", rows, task=Task.of("regression", "review", "label"))
