"""The default job as the README runs it, at a tiny size: one process and a real 2-process launch of cpu.yaml, its log,
schedule, export, trackers, bad input in one line, and what a default run imports."""

import csv
import json
import os

import pytest
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    pipeline,
)

from conftest import (
    ASPECTS,
    CPU_YAML,
    TINY,
    assert_pipeline_predicts_like_the_trained_model,
    assert_refused,
    assert_same_run,
    read_log,
    run_train,
    train_forked,
)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, reviews_csv, cache_dir):
    """A 2-process DDP run on cpu.yaml, launched as users launch it (the fast tier's real launch); an eval batch
    (5) that does not divide the eval set (24)."""
    out = tmp_path_factory.mktemp("ddp")
    result = run_train([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--output_dir", out,
                        "--max_steps", 6, "--eval_steps", 3, "--save_steps", 3, "--warmup_ratio", 0.5,
                        "--per_device_eval_batch_size", 5, "--report_to", "tensorboard"], config_file=CPU_YAML)
    return out, result


# What a fresh default run has no use for, folder by folder: the code of paths it does not take that needs an
# optional package, and the commands built on the core. A folder's other modules are light, and read by every run.
NOT_IN_A_DEFAULT_RUN = {
    "textclf.checkpointing": {"textclf.checkpointing.universal": "DeepSpeed's universal checkpoint (a ZeRO resume on "
                                                                 "another number of processes)"},
    "textclf.models": {"textclf.models.lora": "LoRA's adapters and a LoRA model folder (peft)"},
    "textclf.tasks": {"textclf.tasks.multi_label": "--task multi_label",
                      "textclf.tasks.regression": "--task regression"},
    "textclf": {f"textclf.{command}": "a command of its own" for command in ("check", "predict", "report", "export")},
}


def _saved_scratch_tokenizer(tmp_path, reviews_csv):
    from textclf.models.tokenizer import train_tokenizer

    folder = tmp_path / "tokenizer"
    with open(reviews_csv, encoding="utf-8") as f:
        train_tokenizer([row["review"] for row in csv.DictReader(f)], str(folder))
    return folder


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


BAD_INPUTS = {
    "missing file": (lambda d: ["--data", d / "nope.csv"], "data not found: "),
    "missing text column": (lambda d: ["--data", _write(d / "t.csv", "label,comment\n1,好\n0,差\n")],
                            "has no text column 'review'; its columns are: label, comment"),
    "missing label column": (lambda d: ["--data", _write(d / "l.csv", "review,stars\n好,5\n差,1\n")],
                             "has no label column 'label'; its columns are: review, stars"),
    "empty data set": (lambda d: ["--data", _write(d / "e.csv", "label,review\n")], "is empty"),
    "unseen eval label": (lambda d: ["--data", _write(d / "tr.csv", "label,review\n1,好\n0,差\n1,棒\n0,烂\n"),
                                     "--eval_data", _write(d / "ev.csv", "label,review\n2,一般\n")],
                          "has 1 label ('2') not seen in the training data (known: 2 labels ('0', '1'))"),
    "malformed json lines": (lambda d: ["--data", _write(d / "m.jsonl", '{"review": "好", "label": 1}\n{oops\n')],
                             "cannot parse"),
    "unknown config key": (lambda d: ["--batch_size", "8"], "unknown config key(s) --batch_size"),
    "unknown encoding": (lambda d: ["--encoding", "nonsense-enc"],
                         "--encoding nonsense-enc: not an encoding Python knows; give the file's encoding"),
    "zero batch size": (lambda d: ["--per_device_train_batch_size", "0"],
                        "per_device_train_batch_size must be a positive integer, got 0"),
    "negative batch size": (lambda d: ["--per_device_eval_batch_size", "-1"],
                            "per_device_eval_batch_size must be a positive integer, got -1"),
    # Tasks (tests/tasks/test_task.py trains them):
    "missing pair column": (lambda d: ["--data", _write(d / "p.csv", "label,first\nsame,好\ndifferent,差\n"),
                                       "--text_column", "first", "--text_pair_column", "second"],
                            "has no text_pair column 'second'; its columns are: label, first "
                            "(choose with --text_pair_column)"),
    "multi-label cell that does not parse": (
        lambda d: ["--task", "multi_label",
                   "--data", _write(d / "m.csv", 'label,review\n"[""服务""]",好\n"[服务,",差\n')],
        "m.csv row 2: label cell '[服务,' does not parse as a JSON list"),
    "non-numeric regression target": (lambda d: ["--task", "regression", "--data",
                                                 _write(d / "r.csv", "label,review\n4.5,好\ngood,差\n")],
                                      "r.csv row 2: label 'good' in column 'label' is not a finite number"),
    "label name unseen in training": (
        lambda d: ["--task", "multi_label", "--label_separator", "|",
                   "--data", _write(d / "t.jsonl", '{"review": "好", "label": ["服务"]}\n'
                                                   '{"review": "差", "label": ["房间", "服务"]}\n'),
                   "--eval_data", _write(d / "e.csv", "label,review\n服务|早餐,一般\n")],
        "e.csv has 1 label ('早餐') not seen in the training data (known: 2 labels ('房间', '服务'))"),
}


def refusal(args) -> str:
    """What train.py refuses `args` with, found in this process: parsing, then the data, tokenizer and model
    it would train (what train.py reads before it writes anything)."""
    from textclf.cli import parse_config
    from textclf.errors import InputError
    from textclf.models.job import build_job

    with pytest.raises(InputError) as refused:
        build_job(parse_config(list(map(str, args))))
    return str(refused.value)


def test_two_processes_really_ran_and_said_so(two_process_run):
    out, result = two_process_run
    assert "distributed_type: MULTI_CPU | num_processes: 2" in result.stdout
    run = json.loads((out / "run.json").read_text())
    assert run["num_processes"] == 2 and run["distributed_type"] == "MULTI_CPU"
    assert run["global_batch_size"] == 2 * 8
    assert run["config"]["max_steps"] == 6
    assert set(run["versions"]) >= {"torch", "accelerate", "transformers", "datasets", "deepspeed"}


def test_log_has_every_step_and_each_evaluation_counts_the_whole_eval_set(two_process_run):
    out, _ = two_process_run
    log = read_log(out)
    train_rows = [row for row in log if "loss" in row]
    assert [row["step"] for row in train_rows] == [1, 2, 3, 4, 5, 6]
    evals = [row for row in log if "eval_accuracy" in row]
    assert [row["step"] for row in evals] == [3, 6]
    # 240 rows, 10% held out: 24, evaluated on 2 processes in batches of 5 (padded by the sampler).
    assert all(row["eval_samples"] == 24 for row in evals)
    assert all(0 <= row["eval_accuracy"] <= 1 and 0 <= row["eval_f1"] <= 1 for row in evals)


def test_schedule_warms_up_then_reaches_zero_exactly_at_the_last_optimizer_step(two_process_run):
    out, _ = two_process_run
    lrs = [row["lr"] for row in read_log(out) if "lr" in row]
    peak = 1e-3  # the default learning_rate
    # warmup_ratio 0.5 of 6 steps: 3 warmup steps, then linear decay to 0 at step 6.
    assert lrs == pytest.approx([peak / 3, 2 * peak / 3, peak, 2 * peak / 3, peak / 3, 0.0])


def test_exported_model_loads_with_label_names_and_checkpoints_are_complete(two_process_run):
    out, _ = two_process_run
    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert model.config.id2label == {0: "negative", 1: "positive"}
    classify = pipeline("text-classification", model=str(out / "model"))
    assert classify("质量很好，非常满意")[0]["label"] in {"negative", "positive"}
    for step in (3, 6):
        position = json.loads((out / f"step_{step}" / "position.json").read_text())
        assert position["step"] == step and position["world_size"] == 2
    assert not [p for p in os.listdir(out) if "incomplete" in p]


def test_tensorboard_holds_loss_lr_and_eval_scalars(two_process_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = two_process_run
    event_dirs = {root for root, _, files in os.walk(out / "tensorboard") if any("tfevents" in f for f in files)}
    tags = set()
    for folder in event_dirs:
        events = EventAccumulator(folder)
        events.Reload()
        tags |= set(events.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "train/epoch", "eval/accuracy", "eval/f1"} <= tags  # the Trainer's


def test_the_default_job_resumes_bitwise_exports_and_loads_in_a_pipeline(tmp_path, four_step_run, reviews_csv,
                                                                          cache_dir):
    """The README's story, at a tiny size: `python train.py` (conftest's four_step_run), resumed from its
    step_2 to the same losses and bitwise the same weights; its step_4 exported to the weights the run
    exported itself; the export loaded by `pipeline` from another directory, predicting as the model does."""
    from safetensors.torch import load_file

    from textclf.export import main as export

    resumed = tmp_path / "resumed"
    train_forked([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", 4, "--save_steps", 2,
                  "--output_dir", resumed, "--resume", four_step_run / "step_2"], config_file=None)
    assert_same_run(four_step_run, resumed, from_step=2)
    export([str(four_step_run / "step_4"), str(tmp_path / "exported")])
    exported, at_the_end = (load_file(folder / "model.safetensors") for folder in (tmp_path / "exported",
                                                                                   four_step_run / "model"))
    assert exported.keys() == at_the_end.keys() and all(exported[k].equal(at_the_end[k]) for k in exported)
    assert_pipeline_predicts_like_the_trained_model(tmp_path / "exported")


def test_a_fresh_default_run_imports_only_what_it_runs(four_step_run):
    """The default job's first run (conftest's four_step_run: fresh folder, checkpoints, export) imports none of the
    code that a run on another path needs (DeepSpeed, LoRA, another task kind) or a command: a fork reading one run
    reads only what it ran."""
    imported = set(four_step_run.with_name(f"{four_step_run.name}.imports").read_text(encoding="utf-8").split())
    assert set(NOT_IN_A_DEFAULT_RUN) | {"textclf.data", "textclf.launch", "textclf.loop"} <= imported  # it was seen
    unexpected = {module: why for folder in NOT_IN_A_DEFAULT_RUN.values() for module, why in folder.items()
                  if module in imported}
    assert not unexpected, unexpected


@pytest.mark.slow
def test_ten_classes_named_in_chinese(tmp_path, cache_dir, aspect_files):
    out = tmp_path / "aspects"
    run_train([*TINY, "--data", aspect_files["train"], "--label_column", "aspect",
               "--cache_dir", cache_dir, "--output_dir", out, "--max_steps", 3, "--save_strategy", "no",
               "--per_device_eval_batch_size", 256])
    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    names = list(model.config.id2label.values())
    assert names == sorted(ASPECTS)  # label names in sorted order, as id2label
    classify = pipeline("text-classification", model=str(out / "model"))
    assert classify("这本书的作者写得很精彩")[0]["label"] in names


@pytest.mark.slow
def test_a_local_model_folder_loads_through_from_pretrained(tmp_path, reviews_csv, cache_dir):
    """The real loading path (`--model <folder>`) on a model this test saves itself."""
    source = tmp_path / "tiny-bert"
    tokenizer = AutoTokenizer.from_pretrained(_saved_scratch_tokenizer(tmp_path, reviews_csv))
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, num_labels=3)  # 3 labels: loading must resize the head to 2
    BertForSequenceClassification(config).save_pretrained(source)
    tokenizer.save_pretrained(source)
    out = tmp_path / "out"
    run_train(["--model", source, "--data", reviews_csv, "--output_dir", out, "--max_steps", 2,
               "--max_length", 32, "--report_to", "none", "--save_strategy", "no"])
    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert model.config.hidden_size == 32 and model.config.id2label == {0: "negative", 1: "positive"}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_clear_line_and_writes_nothing(case, tmp_path, cache_dir):
    make_args, message = BAD_INPUTS[case]
    out = tmp_path / "out"
    error = refusal([*TINY, "--cache_dir", cache_dir, "--output_dir", out, *make_args(tmp_path)])
    assert len(error.splitlines()) == 1 and message in error, error
    assert not out.exists()


@pytest.mark.parametrize("case", ["unknown config key", "missing file"])
def test_train_py_says_bad_input_in_one_error_line_with_exit_code_2(case, tmp_path, cache_dir):
    """The command's side of the contract, for one mistake found while parsing and one found in the data."""
    make_args, message = BAD_INPUTS[case]
    out = tmp_path / "out"
    assert_refused(run_train([*TINY, "--cache_dir", cache_dir, "--output_dir", out, *make_args(tmp_path)],
                             check=False), message)
    assert not out.exists()


@pytest.mark.slow  # the refusal's rule is in the fast tier (models/test_speed.py); this is the command's side of it
def test_torch_compile_false_against_the_launchs_dynamo_backend_is_refused_before_anything_is_written(
        tmp_path, reviews_csv, cache_dir):
    """A launch's dynamo settings are taken (models.speed_up compiles the blocks with them); a flag that says
    otherwise is one line."""
    out = tmp_path / "out"
    result = train_forked([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--output_dir", out,
                           "--torch_compile", "false"],
                          launch_args=["--dynamo_backend", "inductor"], check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert "--torch_compile false, but the launch asks for dynamo_backend inductor" in errors[0]
    assert not out.exists()
