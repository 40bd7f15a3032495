"""Where a run reports, all through `accelerator`'s trackers: log.jsonl (the output contract) and the others, under
the Trainer's names."""

import importlib
import json
import os
import sys
import time
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.tracking import (
    LOGGER_TYPE_TO_CLASS,
    GeneralTracker,
    MLflowTracker,
    TensorBoardTracker,
    get_available_trackers,
)
from accelerate.utils import LoggerType

from . import files
from .checkpoint import continue_advice
from .errors import InputError, write_failed

LOG = "log.jsonl"
# Where each tracker takes a run's name (--run_name), among the keyword arguments accelerate passes it.
RUN_NAME_KEYS = {"wandb": "name", "trackio": "name", "swanlab": "experiment_name", "clearml": "task_name"}
# The trackers whose Trainer callbacks group their values as train/<name> and eval/<metric> (transformers'
# integration_utils.rewrite_logs); the Trainer gives the others its flat names (loss, learning_rate, eval_accuracy).
GROUPED = {"tensorboard", "wandb", "trackio", "comet_ml", "swanlab"}
# The Trainer's names for what log.jsonl names otherwise (its keys stay: the output contract).
TRAINER_NAMES = {"lr": "learning_rate"}


class JsonLinesTracker(GeneralTracker):
    """log.jsonl as one of accelerate's trackers: one line per `accelerator.log` call (main process only), with
    the step, its wall-clock `time` (Unix seconds; the benchmark times steps from it) and the values."""

    name, requires_logging_directory, main_process_only = "log.jsonl", True, True

    def __init__(self, output_dir: str):
        super().__init__()
        self.output_dir = output_dir

    @property
    def tracker(self) -> str:
        return os.path.join(self.output_dir, LOG)

    def store_init_configuration(self, values: dict) -> None:
        pass  # run.json holds the config

    def log(self, values: dict, step: Optional[int] = None, **kwargs) -> None:
        try:
            with files.open_append(self.tracker, encoding="utf-8") as f:  # never through a link in its place
                f.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        except OSError as e:
            raise write_failed("append to", self.tracker, e, continue_advice(self.output_dir)) from None


def check_trackers(report_to: list[str]) -> None:
    """Stop now, before anything is written, if a tracker asked for is unknown or cannot start.

    Accelerate drops a tracker whose package is missing without a word (a debug log), its is_*_available
    find a package without importing it, and wandb without a login fails only in `init_trackers`, after
    run.json is written.
    """
    asked = " ".join(report_to)
    available = [str(name) for name in get_available_trackers()]  # accelerate's is_<tracker>_available
    for name in available if report_to == ["all"] else report_to:
        if name == "none":
            continue
        if name not in LOGGER_TYPE_TO_CLASS:
            raise InputError(f"--report_to {asked}: unknown tracker '{name}'; accelerate knows "
                             f"{', '.join(LOGGER_TYPE_TO_CLASS)} (or pass all or none)")
        if name not in map(str, LoggerType):
            continue  # one registered by the user's code, which imports it
        if name not in available:
            raise InputError(f"--report_to {asked}, but {name} is not installed; pip install {name}, or leave it "
                             "out of --report_to")
        try:  # what accelerate's tracker imports when it starts
            package = importlib.import_module("torch.utils.tensorboard" if name == "tensorboard" else name)
        except ImportError as e:
            raise InputError(f"--report_to {asked}, but {name} cannot be imported ({e}); pip install {name}, or "
                             "leave it out of --report_to") from None
        offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun")
        if name == "wandb" and not offline and not package.login(verify=False, prompt=False):
            raise InputError(f"--report_to {asked}, but wandb has no login here (no WANDB_API_KEY, no "
                             "`wandb login`); log in, set WANDB_MODE=offline, or leave it out of --report_to")


def trackers(report_to: list[str], output_dir: str, project_name: Optional[str] = None,
             run_name: Optional[str] = None) -> list:
    """`log_with` for the Accelerator: log.jsonl, and the trackers named (every one installed for 'all').

    The project is --project_name or, unset, each tracker's own convention (WANDB_PROJECT, ...). TensorBoard
    would make it a folder, so it gets <output_dir>/tensorboard[/<run_name>]; MLflow, whose experiment
    accelerate would call "None", gets mlflow's Default experiment, as under the Trainer.
    """
    names = [str(name) for name in get_available_trackers()] if report_to == ["all"] else report_to
    chosen = [JsonLinesTracker(output_dir)]
    for name in names:
        if name == "tensorboard":
            chosen.append(TensorBoardTracker(os.path.join("tensorboard", run_name) if run_name else "tensorboard",
                                             output_dir))
        elif name == "mlflow":  # MLFLOW_EXPERIMENT_NAME still wins, as accelerate reads it
            chosen.append(MLflowTracker(project_name or "Default", run_name=run_name))
        elif name != "none":
            chosen.append(name)
    return chosen


def start_trackers(accelerator: Accelerator, config: dict) -> None:
    """Start the trackers with the run's config, its project (--project_name) and its name (--run_name).

    W&B writes its files under the output folder (not ./wandb, the repository's root when launched from it) unless
    WANDB_DIR says where. `--report_to all` says which trackers it found installed.
    """
    run_name = config.get("run_name")
    init_kwargs = {name: {key: run_name} for name, key in RUN_NAME_KEYS.items()} if run_name else {}
    if not os.environ.get("WANDB_DIR"):
        init_kwargs.setdefault("wandb", {})["dir"] = config["output_dir"]
    accelerator.init_trackers(config.get("project_name"), config=flat_config(config), init_kwargs=init_kwargs)
    if config.get("report_to") == ["all"]:
        others = [tracker.name for tracker in accelerator.trackers if not isinstance(tracker, JsonLinesTracker)]
        accelerator.print(f"--report_to all: {', '.join(others) or 'no tracker installed'}, and {LOG}")


def log(accelerator: Accelerator, values: dict, step: int) -> None:
    """`accelerator.log`, with the Trainer's names in every tracker but log.jsonl: train/loss, train/learning_rate,
    train/epoch, eval/<metric> where its callback groups them (GROUPED), its flat names elsewhere."""
    named = {TRAINER_NAMES.get(key, key): value for key, value in values.items()}
    grouped = {(f"eval/{key[len('eval_'):]}" if key.startswith("eval_") else f"train/{key}"): value
               for key, value in named.items()}
    if accelerator.is_main_process:  # accelerate keeps the trackers there
        for tracker in accelerator.trackers:
            tracker.log(values if isinstance(tracker, JsonLinesTracker) else
                        grouped if tracker.name in GROUPED else named, step=step)


def flat_config(config: dict) -> dict:
    """Trackers accept only plain scalars: None and lists become strings."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}


def keep_log_until(output_dir: str, step: int) -> None:
    """On resume, forget what a killed run logged after its checkpoint, so the log reads as one run.

    A last line cut short (a kill while appending) is dropped with a warning; a damaged line anywhere
    else is not the trace of a kill, and stops the run.
    """
    path = os.path.join(output_dir, LOG)
    if not os.path.lexists(path):
        return
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


class Window:
    """Loss and throughput over the micro-batches since the last log line.

    Its counts (`state`) are part of a checkpoint: a run resumed between two log lines logs the same
    loss at the next one as the run that was never stopped. Its clock restarts.
    """

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
        ids, mask = batch["input_ids"], batch.get("attention_mask")  # no mask: no padding (data.Collator)
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
