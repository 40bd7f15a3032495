"""A resume planned before torch (textclf/checkpointing/plan.py, cli.plan_run): the checkpoint's config under the
command line's, what a flag or recipe may change, every refusal in one launch, relative paths from where the run
started."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import (
    OFFLINE,
    REPO,
    TINY,
    free_port,
    losses,
)
from forked import launch_env, rank_env
from textclf.checkpointing.folders import POSITION
from textclf.checkpointing.plan import seen_from_here
from textclf.checkpointing.write import (
    sealed,
)
from textclf.cli import parse_config, plan_run
from textclf.errors import InputError

ZOO = REPO / "accelerate_configs"


def zero2_checkpoints(folder, steps=(10, 12)) -> list:
    """step_<N>/ folders of a ZeRO-2 run on 2 processes, each with a sealed position.json (no states: the refusals
    come before any is read)."""
    import dataclasses

    from textclf.config import TrainConfig

    made_with = {"model": "scratch-tiny", "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}
    paths = []
    for step in steps:
        path = folder / f"step_{step}"
        path.mkdir(parents=True)
        config = {**dataclasses.asdict(TrainConfig()), **made_with, "output_dir": str(folder)}
        (path / "position.json").write_text(json.dumps(sealed({
            "step": step, "epoch": 0, "batch_in_epoch": step, "world_size": 2, "zero_stage": 2,
            "mixed_precision": "no", "global_batch_size": 16, **made_with, "config": config})))
        paths.append(path)
    return paths


def resume_refusals(checkpoint, later: str) -> list[str]:
    return [f"--resume {checkpoint}: {checkpoint.parent} holds checkpoints after it ({later}), which this run would "
            "write over; pass --overwrite_output_dir to move them aside, or --output_dir <another folder> to keep "
            "both runs",
            f"cannot resume from {checkpoint}: it was made with seed = 42, this run has 7; a resumed run keeps what "
            "shapes its training (leave out --seed, or start a new run in another --output_dir)"]


def resumed_config(argv):
    """The config train.py's command line `argv` resumes with: the checkpoint's config under argv's, as cli.plan_run
    parses it, with the refusals of a changed field (resume_rules.check_against)."""
    from textclf.checkpointing.plan import read_resume
    from textclf.checkpointing.resume_rules import check_against

    resumed = read_resume(parse_config(argv), [])
    if resumed is None:  # nothing to resume: a fresh run's config
        return parse_config(argv)
    cfg = parse_config(argv, under=resumed.made_with)
    check_against(resumed.checkpoint, resumed.position, {"config": cfg.to_dict()})
    return cfg


def fake_checkpoint(folder, **made_with):
    """A step_<N> folder as far as checkpointing.plan's read_resume reads it: position.json holding the config it was
    made with."""
    import dataclasses

    from textclf.config import TrainConfig

    folder.mkdir(parents=True)
    config = {**dataclasses.asdict(TrainConfig()), **made_with}
    (folder / "position.json").write_text(json.dumps({"step": int(folder.name.split("_")[1]), "config": config}))
    return folder


MADE_WITH = {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 2, "learning_rate": 0.002,
             "max_length": 24, "text_column": "comment", "label_column": "sentiment", "logging_steps": 1,
             "data": "/somewhere/reviews.tsv", "encoding": "gb18030", "warmup_steps": 3, "report_to": ["none"]}


def test_a_resume_refused_twice_names_both_refusals_in_one_launch_before_torch(tmp_path):
    """`accelerate launch --config_file accelerate_configs/zero2.yaml train.py --resume checkpoints/step_10 --seed 7`
    beside a later step_12: both refusals at once, not one a launch."""
    step_10, _ = zero2_checkpoints(tmp_path / "run")
    env = {**os.environ, **OFFLINE, **rank_env(launch_env(ZOO / "zero2.yaml", 2, free_port()), 0)}
    result = subprocess.run([sys.executable, "-X", "importtime", "train.py", "--resume", str(step_10), "--seed", "7"],
                            cwd=REPO,
                            capture_output=True, text=True, timeout=120, env=env)
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert said == [f"error: {line}" for line in resume_refusals(step_10, "step_12")], result.stderr[-3000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"torch", "transformers", "datasets", "accelerate"} & imported
    assert sorted(os.listdir(tmp_path / "run")) == ["step_10", "step_12"]


def test_the_plan_adds_the_refusals_to_a_list_it_is_given_and_goes_on(tmp_path, monkeypatch):
    """The check command's use of plan_run: every refusal as a conflict, with the config the resume would train
    with; train.py's raises them together."""
    from textclf.errors import InputError

    step_10, _ = zero2_checkpoints(tmp_path / "run")
    for key, value in rank_env(launch_env(ZOO / "zero2.yaml", 2, free_port()), 0).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(REPO)
    argv = ["--resume", str(step_10), "--seed", "7"]
    refusals = []
    cfg, start = plan_run(parse_config(argv), argv, refusals)
    assert refusals == resume_refusals(step_10, "step_12")
    assert (start.checkpoint, cfg.model, cfg.per_device_train_batch_size) == (str(step_10), "scratch-tiny", 8)
    with pytest.raises(InputError) as refused:
        plan_run(parse_config(argv), argv)
    assert str(refused.value).splitlines() == refusals
    argv = ["--resume", str(step_10), "--overwrite_output_dir"]
    assert plan_run(parse_config(argv), argv)[1].checkpoint == str(step_10)


def test_resume_by_path_alone_takes_the_checkpoint_s_config_and_folder(tmp_path):

    checkpoint = fake_checkpoint(tmp_path / "moved_run" / "step_8", output_dir="/old/place", **MADE_WITH)
    cfg = resumed_config(["--resume", str(checkpoint)])
    assert {key: getattr(cfg, key) for key in MADE_WITH} == MADE_WITH
    assert cfg.output_dir == str(tmp_path / "moved_run")  # the run goes on where its checkpoint is
    assert cfg.resume == str(checkpoint)


def test_resume_latest_finds_the_newest_checkpoint_in_output_dir(tmp_path):

    fake_checkpoint(tmp_path / "run" / "step_4", **{**MADE_WITH, "learning_rate": 0.1})
    fake_checkpoint(tmp_path / "run" / "step_8", **MADE_WITH)
    cfg = resumed_config(["--resume", "latest", "--output_dir", str(tmp_path / "run")])
    assert cfg.learning_rate == 0.002 and cfg.resume == "latest"


def test_resume_auto_starts_fresh_in_an_empty_folder_and_continues_the_newest_checkpoint(tmp_path):
    cfg = resumed_config(["--resume", "auto", "--output_dir", str(tmp_path / "run"), "--learning_rate", "0.1"])
    assert cfg.resume == "auto" and cfg.learning_rate == 0.1  # nothing to continue: a fresh run's config
    fake_checkpoint(tmp_path / "run" / "step_4", **{**MADE_WITH, "learning_rate": 0.1})
    fake_checkpoint(tmp_path / "run" / "step_8", **MADE_WITH)
    cfg = resumed_config(["--resume", "auto", "--output_dir", str(tmp_path / "run")])
    assert cfg.learning_rate == 0.002 and cfg.resume == "auto"  # step_8's config


def test_a_resumed_run_may_train_longer_and_change_cadence_and_outputs(tmp_path):
    from textclf.config import RESUME_MAY_CHANGE, field_names

    assert set(RESUME_MAY_CHANGE) <= set(field_names())
    checkpoint = fake_checkpoint(tmp_path / "run" / "step_8", **MADE_WITH)
    cfg = resumed_config(["--resume", str(checkpoint), "--max_steps", "50", "--logging_steps", "5", "--eval_steps", "4",
                        "--save_steps", "4", "--save_total_limit", "2", "--output_dir", str(tmp_path / "elsewhere"),
                        "--report_to", "tensorboard", "--dataloader_num_workers", "1", "--allow_pickle"])
    assert (cfg.max_steps, cfg.logging_steps, cfg.eval_steps, cfg.per_device_train_batch_size) == (50, 5, 4, 6)
    assert cfg.output_dir == str(tmp_path / "elsewhere")
    assert cfg.eval_strategy == "steps"  # the checkpoint evaluated never; --eval_steps asks for it, as in a new run
    evaluated = fake_checkpoint(tmp_path / "evaluated" / "step_8", eval_strategy="steps", eval_steps=8)
    assert resumed_config(["--resume", str(evaluated), "--eval_strategy", "no"]).eval_strategy == "no"
    assert resumed_config(["--resume", str(evaluated)]).eval_strategy == "steps"


@pytest.mark.parametrize("flags, made, asked", [
    (["--learning_rate", "0.1"], "learning_rate = 0.002", "0.1"),
    (["--per_device_train_batch_size", "32"], "per_device_train_batch_size = 6", "32"),
    (["--gradient_accumulation_steps", "1"], "gradient_accumulation_steps = 2", "1"),
    (["--model", "scratch-mini"], "model = scratch-tiny", "scratch-mini"),
    (["--data", "other.csv"], "data = /somewhere/reviews.tsv", "other.csv"),
    (["--text_column", "review"], "text_column = comment", "review"),
    (["--max_length", "128"], "max_length = 24", "128"),
    (["--seed", "1"], "seed = 42", "1"),
    (["--warmup_steps", "0"], "warmup_steps = 3", "0"),
    (["--lora"], "lora = False", "True"),
    (["--mixed_precision", "bf16"], "mixed_precision = None", "bf16"),
    (["--no_group_by_length"], "group_by_length = True", "False"),
    # the best so far was measured by the checkpoint's metric: another would compare unlike values
    (["--metric_for_best_model", "eval_accuracy"], "metric_for_best_model = eval_f1", "eval_accuracy"),
])
def test_a_flag_that_would_change_the_resumed_run_is_refused_in_one_line(tmp_path, flags, made, asked):

    checkpoint = fake_checkpoint(tmp_path / "run" / "step_8", **MADE_WITH)
    with pytest.raises(InputError) as error:
        resumed_config(["--resume", str(checkpoint), *flags])
    assert str(error.value).startswith(
        f"cannot resume from {checkpoint}: it was made with {made}, this run has {asked}")
    assert "start a new run" in str(error.value)


def test_a_recipe_cannot_change_the_resumed_run_either_and_unknown_options_are_refused(tmp_path):

    checkpoint = fake_checkpoint(tmp_path / "run" / "step_8", **MADE_WITH)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 0.01\n")
    with pytest.raises(InputError, match="made with learning_rate = 0.002, this run has 0.01"):
        resumed_config(["--config", str(recipe), "--resume", str(checkpoint)])
    newer = fake_checkpoint(tmp_path / "newer" / "step_8", torch_compile_mode="max")
    with pytest.raises(InputError,
                       match="its config has option.s. torch_compile_mode that this train.py does not know"):
        resumed_config(["--resume", str(newer)])


def test_a_checkpoint_s_relative_paths_start_where_its_run_started(tmp_path, monkeypatch):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "d.csv").write_text("label,review\n")
    position = {"started_in": str(tmp_path / "project"), "model": "scratch-tiny",
                "config": {"data": "d.csv", "eval_data": "gone.csv", "model": "scratch-tiny", "seed": 1,
                           "cache_dir": "~/.cache/textclf"}}
    monkeypatch.chdir(tmp_path)
    seen = seen_from_here(position)
    assert seen["config"] == {**position["config"], "data": str(tmp_path / "project" / "d.csv")}
    monkeypatch.chdir(tmp_path / "project")
    assert seen_from_here(position) is position


@pytest.mark.slow
def test_a_resume_from_another_folder_finds_the_data_its_run_named_by_a_relative_path(tmp_path, reviews_csv, cache_dir):
    """`--data d.csv` from the folder the run started in, then `--resume <dir>/step_2` from another folder: the
    checkpoint records where its run started, and the resume reads the same d.csv, bit for bit."""
    import subprocess
    import sys

    from conftest import OFFLINE

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    shutil.copy(reviews_csv, project / "d.csv")
    run = [sys.executable, str(REPO / "train.py"), *map(str, TINY), "--cache_dir", str(cache_dir), "--max_steps", "4",
           "--save_steps", "2", "--eval_strategy", "no"]

    def train(cwd, *args):
        result = subprocess.run([*run, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600,
                                env={**os.environ, **OFFLINE})
        assert result.returncode == 0, result.stderr[-3000:]

    train(project, "--data", "d.csv", "--output_dir", "out")
    assert json.loads((project / "out" / "step_2" / POSITION).read_text())["started_in"] == str(project)
    train(elsewhere, "--resume", project / "out" / "step_2", "--output_dir", elsewhere / "resumed")
    assert losses(elsewhere / "resumed") == {step: loss for step, loss in losses(project / "out").items() if step > 2}


def test_a_resume_refused_for_its_launch_answers_before_torch_is_imported(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import REPO

    checkpoint = tmp_path / "out" / "step_3"
    checkpoint.mkdir(parents=True)
    position = {"step": 3, "epoch": 0, "batch_in_epoch": 3, "world_size": 1, "zero_stage": 3, "mixed_precision": "no",
                "global_batch_size": 32, "per_device_train_batch_size": 32, "gradient_accumulation_steps": 1}
    (checkpoint / "position.json").write_text(json.dumps(sealed(position)))
    result = subprocess.run([sys.executable, "-X", "importtime", "train.py", "--resume", str(checkpoint)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(said) == 1, result.stderr[-2000:]
    assert said[0].startswith(f"error: cannot resume from {checkpoint}: it was made by a launch with DeepSpeed ZeRO "
                              "stage 3 (this launch: None)") and "accelerate_configs/zero3.yaml" in said[0]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"torch", "transformers", "datasets", "accelerate"} & imported
