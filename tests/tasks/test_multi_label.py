"""Several labels per text (textclf/tasks/multi_label.py): cells read as lists, predictions above the threshold."""

import torch

from textclf.tasks.task import Task


def test_multi_label_cells_read_as_lists_from_json_lines_delimited_csv_and_json_strings():
    task = Task.of("multi_label", "review", "label", label_separator="|")
    cells = [["服务", "房间"], "房间| 服务 ", '["早餐"]', "", None, [3, 1]]
    assert task.parse_labels(cells, "f") == [["房间", "服务"], ["房间", "服务"], ["早餐"], [], [], ["1", "3"]]
    labels = task.parse_labels(cells[:3], "f")
    names = task.label_names(labels, "f")
    encoded, feature = task.encode_labels(labels, names, "f")
    assert names == ["房间", "早餐", "服务"] and encoded == [[1, 0, 1], [1, 0, 1], [0, 1, 0]]
    assert feature.length == 3


def test_predict_says_when_no_label_is_above_the_threshold():

    task = Task.of("multi_label", "review", "label", threshold=0.7)
    rows = task.prediction_rows(["一般"], None, torch.tensor([[0.0, -1.0]]), ["服务", "价格"])
    assert task.terminal_line(rows[0]) == "(no label above 0.7)\t一般"
