"""python -m textclf.predict (textclf/predict.py): rows in input order on one process and two, never a prompt to run a
folder's code, links at its output replaced."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (
    OFFLINE,
    REPO,
    assert_batched_as_alone,
    assert_refused,
    code_shipping_folder,
    read_csv,
    refusal,
    run_module,
    untouched,
    write_csv,
)
from textclf.data.reading import clean_text
from textclf.models.folder import predict_logits
from textclf.models.trained import inference_accelerator, load_trained
from textclf.predict import main
from textclf.tasks.task import Task


@pytest.fixture(scope="module")
def trained(four_step_run):
    """conftest's tiny model trained for 4 steps on one process: step_4/ and the export model/ hold the same
    weights."""
    return four_step_run


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def test_predict_never_prompts_to_run_a_folder_code(tmp_path):
    """transformers asks "Do you wish to run the custom code? [y/N]" when trust_remote_code is None, and reads
    the answer from stdin: a "y" there must not run it."""
    folder, marker = code_shipping_folder(tmp_path)
    result = subprocess.run([sys.executable, "-m", "textclf.predict", "--model", str(folder), "--text", "好"],
                            cwd=REPO, input="y\ny\n", capture_output=True, text=True, timeout=300,
                            env={**os.environ, **OFFLINE})
    assert_refused(result, "needs custom code to load")
    assert "--trust_remote_code" in result.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_two_processes_write_one_row_per_input_row_in_input_order(trained, tmp_path, corpus_csv):
    # Every 8th review of the default corpus, both labels, all lengths: 2,171, an odd count, so the two processes'
    # shares differ and accelerate evens out their last batches.
    reviews = write_csv(tmp_path / "reviews.csv", read_csv(corpus_csv)[::8])
    args = ["--model", trained / "model", "--file", reviews, "--text_column", "review"]
    # One thread per process in both runs: the same arithmetic, so the outputs can be compared closely.
    run_module("textclf.predict", [*args, "--output", tmp_path / "one.csv"], env={"OMP_NUM_THREADS": "1"})
    result = run_module("textclf.predict", [*args, "--output", tmp_path / "two.csv"],
                        config_file=REPO / "accelerate_configs" / "cpu.yaml", env={"OMP_NUM_THREADS": "1"})
    assert "predict" in result.stderr  # the progress bar

    inputs = [clean_text(row["review"]) for row in read_csv(reviews)]
    one, two = read_csv(tmp_path / "one.csv"), read_csv(tmp_path / "two.csv")
    assert len(inputs) == 2171 and len(one) == len(inputs) and len(two) == len(inputs)
    assert [row["text"] for row in two] == inputs == [row["text"] for row in one]
    assert [row["label"] for row in two] == [row["label"] for row in one]
    # The last batches differ in padding between the two runs (accelerate evens them out with repeated
    # rows), which may change the last bits of a few probabilities.
    for column in ("prob_negative", "prob_positive"):
        assert max(abs(float(a[column]) - float(b[column])) for a, b in zip(one, two)) < 1e-6
    row = two[0]
    assert set(row) == {"text", "label", "label_name", "prob_negative", "prob_positive"}
    assert row["label_name"] == ["negative", "positive"][int(row["label"])]


@pytest.mark.slow
def test_texts_on_the_command_line_from_a_checkpoint_to_json_lines(trained, tmp_path):
    texts = ["送餐很快，味道不错", "等了两个小时，菜都凉了", "一般"]
    output = tmp_path / "out.jsonl"
    run_module("textclf.predict", ["--model", trained / "step_4", "--text", *texts, "--output", output])
    rows = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    assert [row["text"] for row in rows] == texts
    # The checkpoint predicts what the export of the same step predicts.
    model, tokenizer = load_trained(str(trained / "model"))
    expected = predict_logits(model, tokenizer, texts).softmax(dim=-1)
    for row, probabilities in zip(rows, expected):
        assert row["label"] == int(probabilities.argmax())
        assert row["label_name"] == model.config.id2label[row["label"]]
        assert [row["prob_negative"], row["prob_positive"]] == pytest.approx(probabilities.tolist(), abs=1e-6)


def test_sorted_batches_come_back_in_input_order(tiny_model):
    """Batched and sorted by length, each text gets the logits it gets alone (no padding at all)."""
    model, tokenizer = load_trained(str(tiny_model))
    rng = random.Random(0)
    texts = ["好" * rng.randint(1, 40) + "吃" * rng.randint(0, 5) + "差" * rng.randint(0, 3) for _ in range(37)]
    assert_batched_as_alone(model, tokenizer, texts)


def test_a_file_without_the_text_column(tiny_model, tmp_path):
    data = tmp_path / "comments.csv"
    data.write_text("id,comment\n1,好吃\n2,难吃\n", encoding="utf-8")
    result = run_module("textclf.predict", ["--model", tiny_model, "--file", data, "--output", tmp_path / "o.csv"],
                        check=False)
    assert_refused(result, f"{data} has no text column 'review'; its columns are: id, comment "
                           "(choose with --text_column)")
    assert not (tmp_path / "o.csv").exists()


def test_a_model_folder_without_its_weights(tiny_model, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_model / name).read_bytes())
    error = refusal(main, ["--model", folder, "--text", "好吃", "--output", tmp_path / "o.csv"])
    assert f"{folder} is not a complete model folder: it has no weights" in error
    assert not (tmp_path / "o.csv").exists()


def test_an_unknown_output_format(tiny_model, tmp_path):
    error = refusal(main, ["--model", tiny_model, "--text", "好吃", "--output", tmp_path / "o.txt"])
    assert "expected a file ending in .csv or .jsonl" in error


def test_without_output_each_text_s_label_and_probability_go_to_the_terminal(tiny_model, capsys):
    texts = ["送餐很快，味道不错", "等了两个小时，菜都凉了", "一般"]
    before = set(os.listdir(REPO))
    main(["--model", str(tiny_model), "--text", *texts])
    stdout = capsys.readouterr().out
    model, tokenizer = load_trained(str(tiny_model))
    probabilities = predict_logits(model, tokenizer, texts).softmax(dim=-1)
    lines = [line.split("\t") for line in stdout.splitlines()]
    assert [text for _, _, text in lines] == texts
    for (name, probability, _), expected in zip(lines, probabilities):
        assert name == model.config.id2label[int(expected.argmax())]
        assert float(probability) == pytest.approx(float(expected.max()), abs=1e-4)
    assert set(os.listdir(REPO)) == before and "wrote" not in stdout  # nothing written


def test_evaluation_and_a_prediction_of_several_batches_show_a_progress_bar(tiny_model, capsys):
    """Evaluation's bar on the main process, whatever the eval set's size; predict's from two batches on."""
    from datasets import Dataset

    from textclf.data.batches import length_sorted_loader
    from textclf.data.tokenized import tokenize
    from train import evaluate

    model, tokenizer = load_trained(str(tiny_model))
    texts = ["好吃", "太差了", "还行吧", "不错", "一般"]
    predict_logits(model, tokenizer, texts, batch_size=8, progress=True)
    assert "predict" not in capsys.readouterr().err  # one batch: over at once
    predict_logits(model, tokenizer, texts, batch_size=2, progress=True)
    assert "predict: " in capsys.readouterr().err
    table = tokenize(Dataset.from_dict({"text": texts, "labels": [1, 0, 1, 1, 0]}), tokenizer, 32)
    task = Task.of("single_label", "review", "label")
    scores = evaluate(model, length_sorted_loader(table, tokenizer, 8), inference_accelerator(), task,
                      task.scores_with([]))
    assert scores["eval_samples"] == 5 and "eval: " in capsys.readouterr().err


def test_predict_output_and_the_report_s_files_replace_links(tmp_path, victim):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from textclf.predict import write_rows
    from textclf.report import save_figure

    out = tmp_path / "out"
    for name in ("pred.csv", "pred.csv.incomplete", "picture.png", "picture.png.incomplete.png"):
        plant(out / name, victim / "file")
    write_rows([{"text": "好", "label": "positive"}], str(out / "pred.csv"))
    save_figure(plt.figure(), str(out / "picture.png"))
    assert (out / "pred.csv").read_text(encoding="utf-8") == "text,label\n好,positive\n"
    assert (out / "picture.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(os.listdir(out)) == ["picture.png", "pred.csv"]
    assert not any((out / name).is_symlink() for name in os.listdir(out)) and untouched(victim)
