"""The trackers a run reports to besides log.jsonl (--report_to, under the Trainer's names): checked before anything
is written, built for the Accelerator, started. Imported only when --report_to names one."""

import importlib
import os

from accelerate import Accelerator
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, MLflowTracker, TensorBoardTracker, get_available_trackers
from accelerate.utils import LoggerType

from .errors import InputError
from .tracking import LOG, JsonLinesTracker

# Where each tracker takes a run's name (--run_name), among the keyword arguments accelerate passes it.
RUN_NAME_KEYS = {"wandb": "name", "trackio": "name", "swanlab": "experiment_name", "clearml": "task_name"}
# The trackers whose Trainer callbacks group their values as train/<name> and eval/<metric> (transformers'
# integration_utils.rewrite_logs); the Trainer gives the others its flat names (loss, learning_rate, eval_accuracy).
GROUPED = {"tensorboard", "wandb", "trackio", "comet_ml", "swanlab"}
# The Trainer's names for what log.jsonl names otherwise (its keys stay: the output contract).
TRAINER_NAMES = {"lr": "learning_rate"}


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


def named_trackers(report_to: list[str], output_dir: str, project_name=None, run_name=None) -> list:
    """The trackers named (every one installed for 'all'), for tracking.trackers.

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


def start_named(accelerator: Accelerator, config: dict) -> None:
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


def trainer_names(values: dict, tracker: str) -> dict:
    """`values` under the Trainer's names for `tracker`: train/loss, train/learning_rate, train/epoch, eval/<metric>
    where its callback groups them (GROUPED), its flat names elsewhere."""
    named = {TRAINER_NAMES.get(key, key): value for key, value in values.items()}
    if tracker not in GROUPED:
        return named
    return {(f"eval/{key[len('eval_'):]}" if key.startswith("eval_") else f"train/{key}"): value
            for key, value in named.items()}


def flat_config(config: dict) -> dict:
    """Trackers accept only plain scalars: None and lists become strings."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}
