"""python -m textclf.report (textclf/report.py): scores, figures and a TF-IDF baseline on a labelled file."""

import errno
import json
import os

import pytest
from PIL import Image

from conftest import ASPECTS, TINY, run_module, run_train
from textclf.report import font_covering

CATEGORIES = sorted(ASPECTS)  # in id order


@pytest.fixture(scope="module")
def category_model(tmp_path_factory, aspect_files, cache_dir):
    out = tmp_path_factory.mktemp("aspects_run")
    run_train([*TINY, "--data", aspect_files["train"], "--label_column", "aspect", "--cache_dir", cache_dir,
               "--output_dir", out, "--max_steps", 30, "--save_strategy", "no"])
    return out / "model"


@pytest.mark.slow
def test_report_prints_the_table_with_the_ten_category_names_and_draws_the_matrix(category_model, aspect_files,
                                                                                   tmp_path):
    output_dir = tmp_path / "report"
    result = run_module("textclf.report", ["--model", category_model, "--file", aspect_files["eval"],
                                           "--label_column", "aspect", "--output_dir", output_dir])
    report = json.loads((output_dir / "report.json").read_text(encoding="utf-8"))

    # The table: one line per category, by name, with precision, recall, F1 and support.
    lines = result.stdout.splitlines()
    for cat in CATEGORIES:
        row = [line.split() for line in lines if line.split()[:1] == [cat]]
        assert len(row) == 1 and len(row[0]) == 5 and row[0][4] == "20", (cat, result.stdout)
        scores = report["per_class"][cat]
        assert [float(value) for value in row[0][1:4]] == pytest.approx(
            [scores["precision"], scores["recall"], scores["f1"]], abs=1e-4)
    assert f"accuracy {report['accuracy']:.4f} | macro-F1 {report['f1']:.4f} | 200 examples" in result.stdout
    # Beside it, the baseline fitted on the examples the model was trained on: 600 less the 10% held out. Each
    # review names its category, so character n-grams find it.
    baseline = report["baseline"]
    assert baseline["train_examples"] == 540 and baseline["method"].startswith("TF-IDF of character 1-3-grams")
    assert f"baseline: accuracy {baseline['accuracy']:.4f} | macro-F1 {baseline['f1']:.4f} | TF-IDF" in result.stdout
    assert baseline["accuracy"] > 0.8

    # The JSON agrees with itself: the matrix counts every example, its diagonal is the accuracy.
    assert report["labels"] == CATEGORIES and list(report["per_class"]) == CATEGORIES
    matrix = report["confusion_matrix"]
    assert len(matrix) == 10 and all(len(row) == 10 for row in matrix)
    assert [sum(row) for row in matrix] == [20] * 10
    assert report["accuracy"] == pytest.approx(sum(matrix[i][i] for i in range(10)) / 200)
    assert 0 <= report["f1"] <= 1

    # The picture: a real PNG of the size drawn, with the names rendered where an installed font has their glyphs,
    # or else the documented fallback: label ids, and one warning that says so. No glyph missing from the font.
    png = output_dir / "confusion_matrix.png"
    assert png.stat().st_size > 20_000
    with Image.open(png) as image:
        image.verify()
    with Image.open(png) as image:
        # (3 + 0.6 * 10 + 1) x (3 + 0.6 * 10) inches at 120 dpi
        assert image.format == "PNG" and image.size == (1200, 1080)
    assert "missing from font" not in result.stderr
    fallback = "warning: no installed font has glyphs for the label names; the confusion matrix shows label ids"
    assert result.stderr.count(fallback) == (1 if font_covering(CATEGORIES) is None else 0), result.stderr[-3000:]


def test_without_a_font_for_the_names_the_matrix_shows_label_ids_and_says_so(tmp_path, capsys, monkeypatch):
    """The fallback drawn on any machine, whatever fonts it has."""
    import warnings

    from textclf import report

    monkeypatch.setattr(report, "font_covering", lambda texts: None)
    matrix = [[3 if i == j else 0 for j in range(10)] for i in range(10)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report.draw_confusion_matrix({"labels": CATEGORIES, "confusion_matrix": matrix}, "ids",
                                     str(tmp_path / "m.png"))
    assert not [w for w in caught if "missing from font" in str(w.message)]
    assert capsys.readouterr().err.count("the confusion matrix shows label ids (names in report.json)") == 1
    with Image.open(tmp_path / "m.png") as image:
        assert image.format == "PNG" and image.size == (1200, 1080)


def test_labels_the_model_does_not_know_are_one_clear_error(tiny_model, tmp_path):
    data = tmp_path / "labelled.csv"
    data.write_text("label,review\npositive,好吃\nneutral,一般\nnegative,难吃\n", encoding="utf-8")
    result = run_module("textclf.report", ["--model", tiny_model, "--file", data, "--output_dir", tmp_path / "r"],
                        check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert (f"{data} has 1 label ('neutral') not seen in the training data (known: 2 labels ('negative', "
            "'positive'))") in errors[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_the_report_scores_the_examples_the_run_evaluated_by_default_numbers_as_labels(tmp_path, reviews_csv,
                                                                                      cache_dir):
    """The run writes the held-out examples it evaluated (eval.jsonl, in the data's columns and label values);
    the report, given no --file, scores them, and agrees with the run's own last evaluation. Labels 0 and 1 in a
    file match a model trained on 0 and 1; names it was not trained on are still refused."""
    from conftest import read_csv, read_log, train_forked, write_csv

    numbers = write_csv(tmp_path / "numbers.csv", [{"stars": int(row["label"] == "positive"), "text": row["review"]}
                                                   for row in read_csv(reviews_csv)])
    out = tmp_path / "run"
    train_forked([*TINY, "--data", numbers, "--text_column", "text", "--label_column", "stars", "--cache_dir",
                  cache_dir, "--output_dir", out, "--max_steps", 8, "--save_strategy", "no"], config_file=None)
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 24 and all(set(row) == {"text", "stars"} and row["stars"] in ("0", "1") for row in rows)
    assert {row["text"] for row in rows} <= {row["review"] for row in read_csv(reviews_csv)}
    last = [row for row in read_log(out) if "eval_accuracy" in row][-1]

    result = run_module("textclf.report", ["--model", out / "model", "--output_dir", tmp_path / "report",
                                           "--no_baseline"])
    report = json.loads((tmp_path / "report" / "report.json").read_text(encoding="utf-8"))
    assert report["file"] == str(out / "eval.jsonl") and report["labels"] == ["0", "1"]
    assert report["samples"] == last["eval_samples"] == 24
    assert report["accuracy"] == pytest.approx(last["eval_accuracy"]) and "24 examples of" in result.stdout
    # The same file with numbers for labels, as a user's own test file would have them.
    as_numbers = tmp_path / "as_numbers.csv"
    write_csv(as_numbers, [{"text": row["text"], "stars": int(row["stars"])} for row in rows])
    run_module("textclf.report", ["--model", out / "model", "--file", as_numbers, "--output_dir", tmp_path / "again",
                                  "--no_baseline"])
    assert json.loads((tmp_path / "again" / "report.json").read_text())["accuracy"] == report["accuracy"]
    named = write_csv(tmp_path / "named.csv", [{"text": row["review"], "stars": row["label"]}
                                               for row in read_csv(reviews_csv)[:4]])
    refused = run_module("textclf.report", ["--model", out / "model", "--file", named, "--output_dir", tmp_path / "r"],
                         check=False)
    assert refused.returncode == 2 and "not seen in the training data (known: 2 labels ('0', '1'))" in refused.stderr
    moved = tmp_path / "moved"
    (out / "model").rename(moved)
    refused = run_module("textclf.report", ["--model", moved, "--output_dir", tmp_path / "r"], check=False)
    assert refused.returncode == 2 and f"no --file given, and {tmp_path / 'eval.jsonl'}" in refused.stderr


def test_a_report_that_fails_to_write_leaves_no_empty_folder(tmp_path, tiny_model, reviews_csv, monkeypatch):
    from textclf import report
    from textclf.errors import InputError, write_failed

    def failing(path, obj, *args):
        raise write_failed("write", path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "free space")

    monkeypatch.setattr(report, "write_json", failing)
    out = tmp_path / "reports" / "first"
    with pytest.raises(InputError, match="No space left on device"):
        report.main(list(map(str, ["--model", tiny_model, "--file", reviews_csv, "--output_dir", out,
                                   "--no_baseline"])))
    assert os.listdir(tmp_path) == []
