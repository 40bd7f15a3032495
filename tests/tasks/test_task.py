"""What a task is (textclf/tasks/task.py): KINDS, predictions, scores and their direction, heads, the whole eval set
scored, docs/tasks.md's worked kind; the default kind's label cells as users write them, each mistake in one line."""

import dataclasses
import json
import math
import re
import sys
import types
import typing

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.metrics import f1_score
from transformers import AutoModelForSequenceClassification, pipeline

from conftest import (
    ASPECTS,
    CPU_YAML,
    REPO,
    SINGLE,
    TASK_EVAL,
    TASK_TRAIN,
    TINY,
    assert_same_run,
    read_csv,
    read_log,
    run_module,
    splits,
    train_forked,
)
from textclf.data.reading import clean_text
from textclf.errors import InputError
from textclf.models.folder import predict_logits
from textclf.models.trained import load_trained
from textclf.tasks.task import Task

STEPS, RESUME_AT = 8, 6


STEPS, RESUME_AT = 8, 6


TASKS = {  # name: (the fixture with its files, its options)
    "pairs": ("pair_files", ["--text_column", "first", "--text_pair_column", "second"]),
    "multi_label": ("multi_label_files", ["--task", "multi_label", "--label_column", "aspects",
                                          "--label_separator", "|"]),
    "regression": ("rating_files", ["--task", "regression", "--label_column", "rating"]),
}


METRICS = {"pairs": ["eval_accuracy", "eval_f1"], "multi_label": ["eval_micro_f1", "eval_macro_f1",
                                                                  "eval_subset_accuracy"],
           "regression": ["eval_mse", "eval_pearson", "eval_spearman"]}


@pytest.fixture(scope="module")
def task_run(request, tmp_path_factory, cache_dir):
    """`task_run(name)`: (output_dir, the run's options, its files) of the 2-process run, trained once per task.

    Checkpoints every 2 steps, of which rotation keeps the 2 newest and the task's best."""
    runs = {}

    def get(name):
        if name not in runs:
            fixture, options = TASKS[name]
            files = request.getfixturevalue(fixture)
            args = [*TINY, "--per_device_eval_batch_size", 8, "--data", files["train"], "--eval_data", files["eval"],
                    "--cache_dir", cache_dir, "--max_steps", STEPS, "--eval_steps", 2, "--save_steps", 2,
                    "--save_total_limit", 2, *options]
            out = tmp_path_factory.mktemp(name)
            train_forked([*args, "--output_dir", out], config_file=CPU_YAML)
            runs[name] = out, args, files
        return runs[name]

    return get


def eval_inputs(name, files):
    """(texts, pairs or None, rows) of the task's eval file, the texts cleaned as predict cleans them."""
    rows = read_csv(files["eval"])
    if name == "pairs":
        return [clean_text(row["first"]) for row in rows], [clean_text(row["second"]) for row in rows], rows
    return [clean_text(row["review"]) for row in rows], None, rows


@pytest.mark.slow
@pytest.mark.parametrize("name", TASKS)
def test_every_evaluation_scores_the_whole_eval_set_and_rotation_keeps_the_tasks_best(name, task_run):
    out, _, _ = task_run(name)
    run = json.loads((out / "run.json").read_text())
    assert run["num_processes"] == 2
    evals = {row["step"]: row for row in read_log(out) if "eval_samples" in row}
    assert sorted(evals) == [2, 4, 6, 8]
    # gather_for_metrics drops the rows repeated to even out the last batches: 37, not 48.
    assert all(row["eval_samples"] == TASK_EVAL for row in evals.values())
    assert all(set(row) - {"step", "time", "eval_samples"} == set(METRICS[name]) for row in evals.values())
    # The best checkpoint is the highest eval_f1 / eval_micro_f1, or the lowest eval_mse; ties to the newer.
    metric = METRICS[name][1 if name == "pairs" else 0]
    sign = -1 if name == "regression" else 1
    best = max(evals, key=lambda step: (sign * evals[step][metric], step))
    kept = sorted(int(path.name.split("_")[1]) for path in out.glob("step_*"))
    assert kept == sorted({6, 8, best}), (kept, {step: evals[step][metric] for step in evals})


@pytest.mark.slow
@pytest.mark.parametrize("name", TASKS)
def test_resume_on_two_processes_is_the_same_run(name, task_run, tmp_path):
    out, args, _ = task_run(name)
    train_forked([*args, "--output_dir", tmp_path, "--resume", out / f"step_{RESUME_AT}"], config_file=CPU_YAML)
    assert_same_run(out, tmp_path, RESUME_AT)


@pytest.mark.slow
@pytest.mark.parametrize("name", TASKS)
def test_the_export_records_the_task_and_pipeline_applies_its_function(name, task_run):
    out, _, files = task_run(name)
    model_dir = out / "model"
    config = AutoModelForSequenceClassification.from_pretrained(model_dir).config
    training = json.loads((model_dir / "training.json").read_text(encoding="utf-8"))
    assert training["config"]["task"] == {"pairs": "single_label"}.get(name, name)
    if name == "pairs":
        assert config.problem_type == "single_label_classification" and set(config.label2id) == {"same", "different"}
        assert training["config"]["text_pair_column"] == "second"
    elif name == "multi_label":
        assert config.problem_type == "multi_label_classification" and list(config.label2id) == sorted(ASPECTS)
    else:
        assert config.problem_type == "regression" and config.id2label == {0: "score"} and config.num_labels == 1

    texts, pairs, _ = eval_inputs(name, files)
    model, tokenizer = load_trained(str(model_dir))
    logits = predict_logits(model, tokenizer, texts[:5], pairs[:5] if pairs else None)
    expected = {"pairs": logits.softmax(dim=-1), "multi_label": logits.sigmoid(), "regression": logits}[name]
    classify = pipeline("text-classification", model=str(model_dir), top_k=None)
    inputs = [{"text": text, "text_pair": pair} for text, pair in zip(texts, pairs)][:5] if pairs else texts[:5]
    for row, scores in zip(expected, classify(inputs, truncation=True)):  # to max_length, as predict does
        by_label = {score["label"]: score["score"] for score in scores}
        assert [by_label[config.id2label[i]] for i in range(config.num_labels)] == pytest.approx(row.tolist(), abs=1e-5)
    if name == "multi_label":  # independent sigmoids: they do not sum to one as a softmax would
        assert any(abs(float(row.sum()) - 1) > 0.1 for row in expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", TASKS)
def test_predict_and_report_take_the_runs_task_and_columns(name, task_run, tmp_path):
    out, _, files = task_run(name)
    model_dir = out / "model"
    texts, pairs, rows = eval_inputs(name, files)

    # predict: no column or task flags, the export's training.json supplies them.
    run_module("textclf.predict", ["--model", model_dir, "--file", files["eval"], "--output", tmp_path / "p.csv"])
    predicted = read_csv(tmp_path / "p.csv")
    assert [row["text"] for row in predicted] == texts and len(predicted) == TASK_EVAL
    model, tokenizer = load_trained(str(model_dir))
    logits = predict_logits(model, tokenizer, texts, pairs)
    if name == "pairs":
        assert [row["text_pair"] for row in predicted] == pairs
        assert [row["label_name"] for row in predicted] == [model.config.id2label[int(i)] for i in logits.argmax(-1)]
        predictions = [row["label_name"] for row in predicted]
    elif name == "multi_label":
        names = [model.config.id2label[i] for i in range(model.config.num_labels)]
        probabilities = torch.tensor([[float(row[f"prob_{n}"]) for n in names] for row in predicted])
        assert torch.allclose(probabilities, logits.sigmoid(), atol=1e-5)
        predictions = [json.loads(row["label_names"]) for row in predicted]
        assert predictions == [[n for n, p in zip(names, row) if p > 0.5] for row in probabilities.tolist()]
    else:
        predictions = [float(row["score"]) for row in predicted]
        assert predictions == pytest.approx(logits[:, 0].tolist(), abs=1e-5)

    # report: the task's scores, equal to those computed here from predict's rows, and the baseline's.
    result = run_module("textclf.report", ["--model", model_dir, "--file", files["eval"],
                                           "--output_dir", tmp_path / "r"])
    report = json.loads((tmp_path / "r" / "report.json").read_text(encoding="utf-8"))
    keys = [metric.removeprefix("eval_") for metric in METRICS[name]]
    assert report["task"] == {"pairs": "single_label"}.get(name, name) and report["samples"] == TASK_EVAL
    baseline = report["baseline"]
    assert baseline["train_examples"] == TASK_TRAIN and baseline["fit_seconds"] > 0
    assert all(key in report and key in baseline for key in keys)
    assert "model:    " in result.stdout and "baseline: " in result.stdout and "TF-IDF" in result.stdout
    if name == "pairs":
        assert report["accuracy"] == pytest.approx(np.mean([p == row["label"] for p, row in zip(predictions, rows)]))
        assert (tmp_path / "r" / "confusion_matrix.png").is_file()
    elif name == "multi_label":
        truth = [row["aspects"].split("|") for row in rows]
        hot = [[int(n in labels) for n in names] for labels in truth]
        predicted_hot = [[int(n in labels) for n in names] for labels in predictions]
        exact = [set(p) == set(t) for p, t in zip(predictions, truth)]
        assert report["subset_accuracy"] == pytest.approx(np.mean(exact))
        assert report["micro_f1"] == pytest.approx(f1_score(hot, predicted_hot, average="micro", zero_division=0))
        assert {n: report["per_label"][n]["support"] for n in names} == {n: sum(n in t for t in truth) for n in names}
        assert "samples avg" in result.stdout  # the per-label table
    else:
        ratings = [float(row["rating"]) for row in rows]
        assert report["mse"] == pytest.approx(np.mean([(p - r) ** 2 for p, r in zip(predictions, ratings)]), rel=1e-5)
        png = tmp_path / "r" / "predicted_vs_true.png"
        with Image.open(png) as image:
            assert image.format == "PNG" and image.size == (720, 720)  # 6 x 6 inches at 120 dpi


def test_the_split_says_how_it_is_stratified():
    single = Task.of("single_label", "review", "label")
    multi = Task.of("multi_label", "review", "label")
    regression = Task.of("regression", "review", "label")
    assert single.strata([0, 1, 1, 0], 2) == ([0, 1, 1, 0], "stratified by label")
    assert multi.strata([[1, 0], [1, 0], [0, 1], [0, 1]], 2)[1] == "stratified by label set (2 sets)"
    assert multi.strata([[1, 0], [1, 0], [0, 1], [1, 1]], 2) == (
        None, "not stratified: 2 of its 3 label sets occur only once")
    strata, how = regression.strata([float(i) for i in range(100)], 10)
    assert how == "stratified by 10 quantile bins of the target" and np.bincount(strata).tolist() == [10] * 10


def test_logits_become_each_tasks_predictions_and_rows():
    logits = torch.tensor([[2.0, -1.0, 0.5], [-3.0, 0.2, -0.1]])
    names = ["a", "b", "c"]
    single, multi = Task.of("single_label", "t", "l"), Task.of("multi_label", "t", "l", threshold=0.5)
    assert single.predictions(logits).tolist() == [0, 1]
    assert multi.predictions(logits).tolist() == [[1, 0, 1], [0, 1, 0]]
    rows = multi.prediction_rows(["x", "y"], None, logits, names)
    assert [row["label_names"] for row in rows] == [["a", "c"], ["b"]]
    assert rows[0]["prob_a"] == pytest.approx(1 / (1 + math.exp(-2.0)))
    rows = single.prediction_rows(["x", "y"], ["p", "q"], logits, names)
    assert rows[1]["text_pair"] == "q" and rows[1]["label_name"] == "b"
    assert sum(rows[0][f"prob_{n}"] for n in names) == pytest.approx(1)
    regression = Task.of("regression", "t", "l")
    assert regression.prediction_rows(["x"], None, torch.tensor([[3.25]]), ["score"]) == [{"text": "x", "score": 3.25}]
    # Without --output, predict prints one line per row: the prediction, then the text(s).
    assert single.terminal_line(rows[1]) == f"b\t{rows[1]['prob_b']:.4f}\ty\tq"
    assert multi.terminal_line(multi.prediction_rows(["x"], None, logits[:1], names)[0]) == "a,c\tx"
    assert regression.terminal_line({"text": "x", "score": 3.25}) == "3.2500\tx"


def test_each_tasks_scores_and_which_way_is_better():
    multi = Task.of("multi_label", "t", "l").compute_scores([[1, 0, 1], [0, 1, 0]], [[1, 0, 0], [0, 1, 0]])
    # micro: 2 true positives, 1 false positive, no false negative -> F1 = 4 / 5
    # macro: labels a and b are right (F1 1), c was predicted once and never true (F1 0)
    assert multi == pytest.approx({"micro_f1": 0.8, "macro_f1": 2 / 3, "subset_accuracy": 0.5})
    task = Task.of("regression", "t", "l")
    regression = task.compute_scores([1.0, 2.0, 4.0], [1.0, 3.0, 5.0])
    assert regression["mse"] == pytest.approx(2 / 3) and regression["spearman"] == pytest.approx(1.0)
    assert task.compute_scores([2.0, 2.0], [1.0, 3.0])["pearson"] is None  # a constant prediction
    assert not task.greater_is_better("eval_mse") and task.greater_is_better("eval_pearson")


def test_a_task_is_made_by_its_kind():
    assert type(Task.of("multi_label", "t", "l")).__name__ == "MultiLabel"
    with pytest.raises(TypeError, match=r"Task.of\(kind, ...\)"):
        Task("single_label", "t", "l")


def test_each_kind_in_KINDS_loads_its_class_and_its_main_metric_is_one_of_its_scores():
    from textclf.tasks.task import KINDS

    for name, kind in KINDS.items():
        cls = kind.load()
        assert cls.kind == name and kind.main_metric in [f"eval_{key}" for key, _, _ in cls.scores], name


def test_each_kind_gives_the_model_config_its_head():
    """What the model factory sets on the config: the outputs by name, and the problem type that picks the loss."""
    heads = {kind: Task.of(kind, "t", "l").head_config(["a", "b"]) for kind in ("single_label", "multi_label")}
    assert heads["single_label"] == {"num_labels": 2, "id2label": {0: "a", 1: "b"}, "label2id": {"a": 0, "b": 1},
                                     "problem_type": "single_label_classification"}
    assert heads["multi_label"]["problem_type"] == "multi_label_classification"
    regression = Task.of("regression", "t", "l")
    head = regression.head_config(regression.label_names([1.5, 2.0], "f"))
    assert head == {"num_labels": 1, "id2label": {0: "score"}, "label2id": {"score": 0}, "problem_type": "regression"}


def test_the_kind_docs_tasks_md_adds_works_and_passes_its_own_test(monkeypatch):
    """docs/tasks.md's worked example, pasted as a reader would: the class into textclf/tasks/ordinal.py, registered in
    KINDS (which --task offers), and its test."""
    import textclf.tasks.task
    from textclf.config import TrainConfig

    task_field = next(field for field in dataclasses.fields(TrainConfig) if field.name == "task")
    assert typing.get_args(task_field.type) == tuple(textclf.tasks.task.KINDS)  # --task offers the registry's kinds
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "tasks.md").read_text(encoding="utf-8"), re.S)
    [kind] = [block for block in blocks if "class Ordinal" in block]
    [entry] = [block for block in blocks if block.lstrip().startswith('"ordinal": Kind(')]
    [test] = [block for block in blocks if "def test_" in block]
    ordinal = types.ModuleType("textclf.tasks.ordinal")
    ordinal.__package__ = "textclf.tasks"
    monkeypatch.setitem(sys.modules, "textclf.tasks.ordinal", ordinal)
    exec(kind, vars(ordinal))
    for name, registered in eval("{" + entry + "}", vars(textclf.tasks.task)).items():
        monkeypatch.setitem(textclf.tasks.task.KINDS, name, registered)
        assert registered.main_metric in [f"eval_{key}" for key, _, _ in registered.load().scores]
    tests = {"pytest": pytest, "torch": torch, "Task": Task, "InputError": InputError}
    exec(test, tests)
    [run] = [function for name, function in tests.items() if name.startswith("test_")]
    run()


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
