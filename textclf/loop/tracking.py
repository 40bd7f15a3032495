"""Where a run reports, through accelerate's trackers: log.jsonl (the output contract: a line per `accelerator.log`),
and the trackers --report_to names, under the Trainer's names, each checked before anything is written; the loss and
throughput of each log line (Window), which a checkpoint carries."""

import json
import math
import os
import sys
import time
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.tracking import (
    GeneralTracker,
    MLflowTracker,
    TensorBoardTracker,
    get_available_trackers,
)

from textclf import files
from textclf.checkpointing import continue_advice
from textclf.config import TrainConfig
from textclf.errors import InputError, write_failed

LOG = "log.jsonl"


class JsonLinesTracker(GeneralTracker):
    """log.jsonl as one of accelerate's trackers: a line per `accelerator.log` (main process), with the step, its
    wall-clock `time` (the benchmark times steps from it) and the values. `tracker_folders`: where the other
    trackers write inside the output folder (tracker_folders), made real folders when this one starts."""

    name, requires_logging_directory, main_process_only = "log.jsonl", True, True

    def __init__(self, output_dir: str, tracker_folders: tuple[str, ...] = ()):
        super().__init__()
        self.output_dir = output_dir
        self.tracker_folders = tracker_folders

    @property
    def tracker(self) -> str:
        return os.path.join(self.output_dir, LOG)

    def start(self) -> None:
        """The first tracker to start (accelerate starts them in log_with's order, on the main process, once the run
        owns its output folder): a link planted in place of another tracker's folder is removed, not written
        through, since that tracker's own code follows it."""
        for folder in self.tracker_folders:
            try:
                files.real_folders(self.output_dir, folder)
            except OSError as e:
                raise write_failed("create", os.path.join(self.output_dir, folder), e,
                                   continue_advice(self.output_dir)) from None

    def store_init_configuration(self, values: dict) -> None:
        pass  # run.json holds the config

    def log(self, values: dict, step: Optional[int] = None, **kwargs) -> None:
        try:
            with files.open_append(self.tracker, encoding="utf-8") as f:  # never through a link in its place
                f.write(json.dumps({"step": step, "time": time.time(), **finite_or_named(values)}, allow_nan=False)
                        + "\n")
        except OSError as e:
            raise write_failed("append to", self.tracker, e, continue_advice(self.output_dir)) from None


def finite_or_named(values: dict) -> dict:
    """`values` with each float that JSON cannot hold (NaN, inf: json.dumps would write a bare NaN, which strict
    readers refuse) as the string JavaScript and float() both read: "NaN", "Infinity", "-Infinity"."""
    def named(value):
        if isinstance(value, float) and not math.isfinite(value):
            return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
        return value

    return {key: named(value) for key, value in values.items()}


def log_with(cfg: TrainConfig) -> list:
    """The Accelerator's `log_with`: log.jsonl, and the trackers --report_to names (checked before the heavy imports:
    check_launch_early)."""
    if cfg.report_to == ["none"]:
        return [JsonLinesTracker(cfg.output_dir)]
    named = named_trackers(cfg.report_to, cfg.output_dir, cfg.project_name, cfg.run_name)
    return [JsonLinesTracker(cfg.output_dir, tracker_folders(named, cfg.output_dir)), *named]


def tracker_folders(trackers: list, output_dir: str) -> tuple[str, ...]:
    """Where `trackers` (named_trackers') write inside output_dir, relative to it: TensorBoard's folder, W&B's
    wandb/ (its dir is the output folder unless WANDB_DIR says otherwise: tracker_config), Aim's .aim/ (accelerate
    gives it the output folder as its repository). A folder outside the output folder (an absolute --run_name) is
    the user's choice."""
    folders = []
    for tracker in trackers:
        if isinstance(tracker, TensorBoardTracker):
            folders.append(os.path.relpath(os.path.join(tracker.logging_dir_param, tracker.run_name), output_dir))
        elif str(tracker) == "wandb" and not os.environ.get("WANDB_DIR"):
            folders.append("wandb")
        elif str(tracker) == "aim":
            folders.append(".aim")
    return tuple(folder for folder in folders
                 if not os.path.isabs(folder) and folder.split(os.sep)[0] not in (os.pardir, os.curdir))


def tracker_config(cfg: TrainConfig) -> dict:
    """`init_trackers`' config and init_kwargs: the run's config as plain scalars (trackers accept no others), and
    its name (--run_name) where each tracker takes one. W&B writes its files under the output folder (not ./wandb,
    the repository's root when launched from it) unless WANDB_DIR says where."""
    init_kwargs = {name: {key: cfg.run_name} for name, key in RUN_NAME_KEYS.items()} if cfg.run_name else {}
    if not os.environ.get("WANDB_DIR") and cfg.report_to != ["none"]:
        init_kwargs.setdefault("wandb", {})["dir"] = cfg.output_dir
    flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in cfg.to_dict().items()}
    return {"config": flat, "init_kwargs": init_kwargs}


class TrainerNamed:
    """One of the trackers --report_to names, which `accelerator.log` gives the Trainer's names for what log.jsonl
    logs (its keys stay: the output contract)."""

    def __init__(self, tracker):
        self.wrapped = tracker

    def __getattr__(self, name):
        return getattr(self.wrapped, name)

    def log(self, values: dict, step: Optional[int] = None, **kwargs) -> None:
        self.wrapped.log(trainer_names(values, self.wrapped.name), step=step, **kwargs)


def use_trainer_names(accelerator: Accelerator, report_to: list[str]) -> None:
    """After `init_trackers`: every tracker but log.jsonl logs under the Trainer's names; `--report_to all` says
    which trackers it found installed."""
    accelerator.trackers[:] = [tracker if isinstance(tracker, JsonLinesTracker) else TrainerNamed(tracker)
                               for tracker in accelerator.trackers]
    if report_to == ["all"]:
        others = [tracker.name for tracker in accelerator.trackers if not isinstance(tracker, JsonLinesTracker)]
        accelerator.print(f"--report_to all: {', '.join(others) or 'no tracker installed'}, and {LOG}")


def keep_log_until(output_dir: str, step: int) -> None:
    """On resume, forget what a killed run logged after its checkpoint (cut_log): a fresh run has no log."""
    if os.path.lexists(os.path.join(output_dir, LOG)):
        cut_log(os.path.join(output_dir, LOG), step)


class Window:
    """Loss and throughput over the micro-batches since the last log line. Its counts go in a checkpoint: a run
    resumed between two log lines logs the same loss at the next as the run never stopped (its clock restarts)."""

    def __init__(self, state: Optional[dict] = None):
        self.start = time.perf_counter()
        self.loss_sum, self.losses = 0.0, 0
        self.samples = self.real_tokens = self.padded_tokens = 0
        if state:
            # A float32 sum read back as a Python float: the next addition rounds exactly as it would have.
            self.loss_sum, self.losses = state["loss_sum"], state["losses"]
            self.samples, self.real_tokens, self.padded_tokens = (
                state["samples"], state["real_tokens"], state["padded_tokens"])

    def state(self) -> dict:
        return {"loss_sum": float(self.loss_sum), "losses": self.losses, "samples": self.samples,
                "real_tokens": int(self.real_tokens), "padded_tokens": self.padded_tokens}

    def add(self, loss: torch.Tensor, batch: dict) -> None:
        """Count one micro-batch and its loss."""
        self.loss_sum += loss.detach().float()
        self.losses += 1
        ids, mask = batch["input_ids"], batch.get("attention_mask")  # no mask: no padding (the collator drops it)
        self.samples += ids.shape[0]
        self.real_tokens += ids.numel() if mask is None else mask.sum()
        self.padded_tokens += ids.numel()

    def summary(self, accelerator: Optional[Accelerator] = None) -> dict:
        """Averaged (loss) or summed (counts) over all processes of `accelerator`, or this one alone."""
        local = torch.tensor([float(self.loss_sum) / max(self.losses, 1), self.samples, float(self.real_tokens),
                              self.padded_tokens], dtype=torch.float64,
                             device=accelerator.device if accelerator else "cpu")
        processes = accelerator.num_processes if accelerator else 1
        loss, samples, real, padded = (accelerator.reduce(local, reduction="sum") if accelerator else local).tolist()
        seconds = time.perf_counter() - self.start
        return {**({"loss": loss / processes} if self.losses else {}),
                "samples_per_s": samples / seconds, "real_tokens_per_s": real / seconds,
                "real_token_fraction": real / padded}


# Where each tracker takes a run's name (--run_name), among the keyword arguments accelerate passes it.
RUN_NAME_KEYS = {"wandb": "name", "trackio": "name", "swanlab": "experiment_name", "clearml": "task_name"}

# The trackers whose Trainer callbacks group their values as train/<name> and eval/<metric> (transformers'
# integration_utils.rewrite_logs); the Trainer gives the others its flat names (loss, learning_rate, eval_accuracy).
GROUPED = {"tensorboard", "wandb", "trackio", "comet_ml", "swanlab"}

# The Trainer's names for what log.jsonl names otherwise (its keys stay: the output contract).
TRAINER_NAMES = {"lr": "learning_rate"}


def named_trackers(report_to: list[str], output_dir: str, project_name=None, run_name=None) -> list:
    """The trackers named (every one installed for 'all'), for log_with.

    The project is --project_name or, unset, each tracker's own convention (WANDB_PROJECT, ...). TensorBoard
    would make it a folder, so it gets <output_dir>/tensorboard[/<run_name>]; MLflow, whose experiment
    accelerate would call "None", gets mlflow's Default experiment, as under the Trainer.
    """
    names = [str(name) for name in get_available_trackers()] if report_to == ["all"] else report_to
    chosen = []
    for name in names:
        if name == "tensorboard":
            chosen.append(TensorBoardTracker(os.path.join("tensorboard", run_name) if run_name else "tensorboard",
                                             output_dir))
        elif name == "mlflow":  # MLFLOW_EXPERIMENT_NAME still wins, as accelerate reads it
            chosen.append(MLflowTracker(project_name or "Default", run_name=run_name))
        elif name != "none":
            chosen.append(name)
    return chosen


def trainer_names(values: dict, tracker: str) -> dict:
    """`values` under the Trainer's names for `tracker`: train/loss, train/learning_rate, train/epoch, eval/<metric>
    where its callback groups them (GROUPED), its flat names elsewhere."""
    named = {TRAINER_NAMES.get(key, key): value for key, value in values.items()}
    if tracker not in GROUPED:
        return named
    return {(f"eval/{key[len('eval_'):]}" if key.startswith("eval_") else f"train/{key}"): value
            for key, value in named.items()}


def cut_log(path: str, step: int) -> None:
    """On resume, forget what a killed run logged after its checkpoint (keep_log_until), so that the log
    at `path` reads as one run.

    A last line cut short (a kill while appending) is dropped with a warning; a damaged line anywhere
    else is not the trace of a kill, and stops the run.
    """
    try:
        with files.open_existing(path) as f:  # a link in its place is refused, not read and replaced
            lines = [line for line in f.read().split(b"\n") if line.strip()]
    except OSError as e:
        raise write_failed("rewrite", path, e, "make it a file of this run's, then resume again") from None
    kept = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line.decode("utf-8"))
            logged_at = row["step"]
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError):
            if number < len(lines):
                raise InputError(f"{path} line {number} is damaged (not a JSON object with a step): repair or "
                                 "delete that line, then resume again") from None
            print(f"warning: {path}: dropped its last line, cut short by the end of the previous run: "
                  f"{line[:80]!r}", file=sys.stderr)
            continue
        if logged_at <= step:
            kept.append(line + b"\n")
    with files.replacing(path, "wb", what="rewrite", advice="free space or make it writable, then resume again") as f:
        f.writelines(kept)
