"""log.jsonl and the trackers (textclf/loop/tracking.py): strict JSON, a torn last line, links at the trackers' folders,
the Trainer's names, the run's name and project."""

import json
import math
import os

import pytest
from accelerate import Accelerator

from conftest import (
    one_line,
    plant,
    untouched,
)
from textclf.checkpointing.folders import POSITION
from textclf.errors import InputError


@pytest.fixture
def fresh_accelerator_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_log_jsonl_stays_strict_json_when_a_loss_is_not_finite(tmp_path):
    from textclf.loop.tracking import JsonLinesTracker

    tracker = JsonLinesTracker(str(tmp_path))
    tracker.log({"loss": float("nan"), "grad_norm": float("inf"), "lr": -math.inf, "epoch": 0.5}, step=3)

    def refuse(constant):
        raise AssertionError(f"a bare {constant} in log.jsonl")

    row = json.loads((tmp_path / "log.jsonl").read_text(), parse_constant=refuse)
    assert (row["loss"], row["grad_norm"], row["lr"], row["epoch"]) == ("NaN", "Infinity", "-Infinity", 0.5)
    assert math.isnan(float(row["loss"]))  # what float() reads back


def test_keep_log_until_drops_a_torn_last_line_but_refuses_damage_elsewhere(tmp_path, capsys):
    from textclf.errors import InputError
    from textclf.loop.tracking import keep_log_until

    rows = [json.dumps({"step": step, "loss": 0.5}) for step in (1, 2, 3)]
    (tmp_path / "log.jsonl").write_bytes(("\n".join(rows) + "\n" + rows[2][:9]).encode() + "\xe4\xbd".encode("latin-1"))
    keep_log_until(str(tmp_path), 2)
    assert (tmp_path / "log.jsonl").read_text() == rows[0] + "\n" + rows[1] + "\n"
    assert "dropped its last line" in capsys.readouterr().err
    (tmp_path / "log.jsonl").write_text(rows[0] + "\n{\"step\": 2, \"lo\n" + rows[2] + "\n")
    with pytest.raises(InputError, match="line 2 is damaged"):
        keep_log_until(str(tmp_path), 3)


def test_a_failed_log_write_advises_resume_only_when_a_checkpoint_exists(tmp_path):
    from textclf.loop.tracking import LOG, JsonLinesTracker

    (tmp_path / LOG).mkdir()  # the log cannot be appended to, as on a full disk
    with pytest.raises(InputError) as refused:
        JsonLinesTracker(str(tmp_path)).log({"loss": 0.5}, step=1)
    assert one_line(refused).endswith("and start again: no checkpoint was completed yet")
    assert "--resume" not in str(refused.value)
    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_2" / POSITION).write_text("{}")
    with pytest.raises(InputError, match=r"then continue with --resume latest \(the newest complete checkpoint, "
                                         r".*step_2, is untouched\)"):
        JsonLinesTracker(str(tmp_path)).log({"loss": 0.5}, step=3)


def test_tensorboard_scalars_read_back_under_the_run_name_and_the_project_is_never_tensorboard(
        tmp_path, monkeypatch, fresh_accelerator_state):
    """And the trackers get the Trainer's names (transformers' integrations): train/loss, train/learning_rate,
    train/epoch (fractional), eval/<metric> in TensorBoard; loss, learning_rate, eval_<metric> in a tracker whose
    Trainer callback keeps them flat; log.jsonl keeps its own keys."""
    from accelerate.state import AcceleratorState
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from textclf import loop
    from textclf.config import TrainConfig
    from textclf.loop.tracking import LOG

    class Recorder(GeneralTracker):
        """A tracker registered the way accelerate documents (register_tracker_class): records its project."""
        name, requires_logging_directory, projects, logged = "recorder", False, [], []

        def __init__(self, project_name, **kwargs):
            super().__init__()
            Recorder.projects.append(project_name)

        @property
        def tracker(self):
            return None

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kwargs):
            Recorder.logged.append(values)

    monkeypatch.setitem(LOGGER_TYPE_TO_CLASS, "recorder", Recorder)
    for project in (None, "reviews"):
        out = tmp_path / str(project)
        cfg = TrainConfig(report_to=["tensorboard", "recorder"], run_name="first", project_name=project,
                          output_dir=str(out))
        accelerator = Accelerator(cpu=True, log_with=loop.log_with(cfg), project_dir=cfg.output_dir)
        accelerator.init_trackers(cfg.project_name, **loop.tracker_config(cfg))  # as train.py starts them
        loop.use_trainer_names(accelerator, cfg.report_to)
        for step in (1, 2):
            accelerator.log({"loss": 1.0 / step, "lr": 0.25, "epoch": step / 4}, step=step)
        accelerator.log({"eval_accuracy": 0.75}, step=2)
        accelerator.end_training()
        AcceleratorState._reset_state(True)
    assert Recorder.projects == [None, "reviews"]  # each tracker's own convention, or --project_name
    events = EventAccumulator(str(tmp_path / "None" / "tensorboard" / "first"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "train/learning_rate", "train/epoch", "eval/accuracy"}
    assert [(event.step, event.value) for event in events.Scalars("train/loss")] == [(1, 1.0), (2, 0.5)]
    assert [event.value for event in events.Scalars("train/epoch")] == [0.25, 0.5]
    assert Recorder.logged[:3] == [{"loss": 1.0, "learning_rate": 0.25, "epoch": 0.25},
                                   {"loss": 0.5, "learning_rate": 0.25, "epoch": 0.5}, {"eval_accuracy": 0.75}]
    # log.jsonl is one of the trackers: accelerator.log wrote it too, one line per call, in its own names
    logged = [json.loads(line) for line in (tmp_path / "None" / LOG).read_text().splitlines()]
    assert [(row["step"], row["loss"], row["lr"]) for row in logged[:2]] == [(1, 1.0, 0.25), (2, 0.5, 0.25)]


def test_report_to_all_names_the_trackers_it_chose_and_wandb_writes_under_the_output_folder(
        tmp_path, monkeypatch, capsys, fresh_accelerator_state):

    from textclf import loop
    from textclf.config import TrainConfig
    from textclf.loop import tracking

    monkeypatch.setattr(tracking, "get_available_trackers", lambda: ["tensorboard"])
    monkeypatch.delenv("WANDB_DIR", raising=False)
    cfg = TrainConfig(report_to=["all"], output_dir=str(tmp_path / "out"))
    accelerator = Accelerator(cpu=True, log_with=loop.log_with(cfg), project_dir=cfg.output_dir)
    started = loop.tracker_config(cfg)["init_kwargs"]
    accelerator.init_trackers(cfg.project_name, **loop.tracker_config(cfg))  # as train.py starts them
    loop.use_trainer_names(accelerator, cfg.report_to)
    accelerator.end_training()
    assert "--report_to all: tensorboard, and log.jsonl" in capsys.readouterr().out
    assert started["wandb"] == {"dir": cfg.output_dir}  # not ./wandb, the repository's root under a launch


@pytest.mark.parametrize("project, variable, experiment", [
    (None, None, "Default"), ("reviews", None, "reviews"), (None, "from-env", "from-env"),
])
def test_mlflow_s_experiment_is_never_none(monkeypatch, tmp_path, project, variable, experiment):
    """mlflow is not installed here: the experiment is what accelerate's MLflowTracker will start under
    (--project_name, or MLFLOW_EXPERIMENT_NAME, else mlflow's Default experiment as under the Trainer)."""
    from accelerate.tracking import MLflowTracker

    from textclf.loop.tracking import named_trackers

    if variable:
        monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", variable)
    else:
        monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    [mlflow] = [t for t in named_trackers(["mlflow"], str(tmp_path), project, "first") if t.name == "mlflow"]
    assert isinstance(mlflow, MLflowTracker) and (mlflow.experiment_name, mlflow.run_name) == (experiment, "first")


def test_a_link_in_place_of_log_jsonl_is_refused_when_appending_and_when_resuming(tmp_path, victim):
    from textclf.loop.tracking import LOG, JsonLinesTracker, keep_log_until

    out = tmp_path / "out"
    plant(out / LOG, victim / "file")
    for write in (lambda: JsonLinesTracker(str(out)).log({"loss": 0.5}, step=1), lambda: keep_log_until(str(out), 2)):
        with pytest.raises(InputError, match=f"{out / LOG} is a symbolic link .* never writes through one"):
            write()
    (out / LOG).unlink()
    (out / LOG).write_text('{"step": 1}\n{"step": 3}\n')
    plant(out / f"{LOG}.tmp", victim / "file")
    keep_log_until(str(out), 2)  # its temporary file replaces the link
    assert (out / LOG).read_text() == '{"step": 1}\n' and untouched(victim)


@pytest.mark.parametrize("run_name", [None, "first"], ids=["tensorboard", "tensorboard/<run_name>"])
def test_a_link_at_a_tracker_s_folder_is_removed_not_written_through(tmp_path, victim, run_name):
    """The trackers started as train.py starts them: log_with's Accelerator, then init_trackers."""
    from accelerate.state import AcceleratorState

    from textclf import loop
    from textclf.config import TrainConfig

    out = tmp_path / "out"
    linked = out / "tensorboard" / run_name if run_name else out / "tensorboard"
    linked.parent.mkdir(parents=True)
    linked.symlink_to(victim)
    cfg = TrainConfig(output_dir=str(out), report_to=["tensorboard"], run_name=run_name)
    try:
        accelerator = Accelerator(cpu=True, log_with=loop.log_with(cfg), project_dir=cfg.output_dir)
        accelerator.init_trackers(cfg.project_name, **loop.tracker_config(cfg))
        accelerator.log({"loss": 0.5}, step=1)
        accelerator.end_training()
    finally:
        AcceleratorState._reset_state(True)
    assert untouched(victim)
    assert not linked.is_symlink() and any(name.startswith("events.out.tfevents") for name in os.listdir(linked))


def test_the_folders_of_the_trackers_named_are_those_inside_the_output_folder(tmp_path, monkeypatch):
    from textclf.loop.tracking import named_trackers, tracker_folders

    out = str(tmp_path / "out")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    assert tracker_folders(named_trackers(["tensorboard", "wandb", "aim", "mlflow"], out, run_name="r"), out) == (
        os.path.join("tensorboard", "r"), "wandb", ".aim")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    assert tracker_folders(named_trackers(["wandb"], out), out) == ()
    assert tracker_folders(named_trackers(["tensorboard"], out, run_name=str(tmp_path / "abs")), out) == ()
