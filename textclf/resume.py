"""Resume, decided in one place: planned once from the checkpoint before the Accelerator exists, restored once
after `accelerator.prepare`.

`plan_resume` runs before torch is imported (train.py calls it right after the command line), so a resume that this
launch cannot continue is refused in a fraction of a second. It finds the checkpoint `--resume` names, lays the
config the checkpoint was made with under the command line's, refuses what would make it another run, and works
out what the checkpoint needs of this launch: the gradient accumulation that keeps its global batch, its loop
position counted in this launch's batches, and whether ZeRO's states go through a universal checkpoint.

`restore` (collective) checks the checkpoint against the run that was built (launch, data, model, schedule,
every file as saved) and loads it. A fresh run passes through both unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from . import checkpoint
from .config import RESUME_MAY_CHANGE, TrainConfig, field_names, parse_config
from .errors import InputError, say
from .launch import this_launch

if TYPE_CHECKING:  # torch and accelerate are loaded after plan_resume has run
    from accelerate import Accelerator

FRESH = {"step": 0, "epoch": 0, "batch_in_epoch": 0}
SPLIT = ("per_device_train_batch_size", "gradient_accumulation_steps")  # how a launch splits the global batch


@dataclass(frozen=True)
class Resume:
    """Where a run starts: a fresh run (checkpoint None), or the checkpoint it continues."""

    checkpoint: Optional[str] = None
    position: dict = dataclasses.field(default_factory=lambda: dict(FRESH))
    """The loop position (and the loss window, the best evaluation), counted in this launch's batches."""
    universal: bool = False
    """ZeRO's states were partitioned over another number of processes: they load through DeepSpeed's universal
    checkpoint, which the Accelerator is told before prepare."""
    asked_split: dict = dataclasses.field(default_factory=dict)
    """The micro-batch and accumulation the run asked for, which its checkpoints record: a launch of another size
    splits the global batch otherwise, and the same command then resumes them again on any number of processes."""


def plan_resume(cfg: TrainConfig, argv: Optional[list[str]] = None) -> tuple[TrainConfig, Resume]:
    """The config this run trains with, and where it starts. `argv`: the command line that made `cfg`, parsed
    again over the checkpoint's config (what it does not set comes from the checkpoint); without it, `cfg` (a
    config built in code) is taken as it is and must agree with the checkpoint."""
    path, position, cfg = resolve(cfg, argv)
    asked = {key: getattr(cfg, key) for key in SPLIT}
    if path is None:
        return cfg, Resume(asked_split=asked)
    launch = this_launch(cfg.mixed_precision)
    world_size = launch["num_processes"]
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    rescaled = checkpoint.check_launch(path, position, {**launch, "distributed_type": "FSDP" if fsdp else None})
    if rescaled:
        say(rescaled)
    cfg = dataclasses.replace(cfg, **checkpoint.batch_split(path, position, world_size))
    return cfg, Resume(
        checkpoint=path, asked_split=asked,
        position=checkpoint.on_this_launch(position, world_size, cfg.gradient_accumulation_steps,
                                           cfg.per_device_train_batch_size),
        universal=checkpoint.needs_universal(path, position, world_size, cfg.load_best_model_at_end))


def resolve(cfg: TrainConfig, argv: Optional[list[str]] = None) -> tuple[Optional[str], dict, TrainConfig]:
    """The checkpoint that --resume names (None: a fresh run), its position as saved, and the config the run
    trains with (plan_resume's `argv`)."""
    # The folder the run goes on in: the one given, or (for a step_<N> path) the checkpoint's own.
    output_dir = cfg.output_dir
    if cfg.resume not in (None, "latest", "auto") and output_dir == TrainConfig.output_dir:
        output_dir = os.path.dirname(os.path.normpath(cfg.resume)) or "."
    path = checkpoint.find_resume_checkpoint(cfg.resume, output_dir, cfg.overwrite_output_dir)
    if path is None:
        return None, dict(FRESH), cfg
    position = checkpoint.read_verified_position(path)
    made_with = config_of(path, position)
    if made_with is not None:
        if argv is not None:
            cfg = parse_config(argv, under=made_with)
        check_resumable(cfg, path, made_with)
    return path, position, cfg


def config_of(path: str, position: dict) -> Optional[dict]:
    """The config the checkpoint was made with, as defaults for the resumed run: its output_dir becomes the
    folder that holds the checkpoint, so the run goes on where it was (even when the folder has moved). None for a
    checkpoint written before checkpoints held their config: every flag must then be given again."""
    config = position.get("config")
    if config is None:
        return None
    unknown = sorted(set(config) - set(field_names()))
    if unknown:
        raise InputError(f"cannot resume from {path}: its config has option(s) {', '.join(unknown)} that this "
                         "train.py does not know; resume it with the version of train.py that made it")
    if config.get("eval_strategy") == ("steps" if config.get("eval_steps") else "no"):
        config["eval_strategy"] = None  # derived from eval_steps: derive it again, from this run's eval_steps
    # Moving the folder aside was the starting run's act, not part of the run: a resume does not repeat it.
    return {**config, "output_dir": os.path.dirname(os.path.normpath(path)) or ".", "resume": None,
            "overwrite_output_dir": False}


def check_resumable(cfg: TrainConfig, path: str, made_with: dict) -> None:
    """Refuse a value that differs from the checkpoint's where the resumed run would not be the same run."""
    # Options newer than the checkpoint ran at their defaults.
    made_with = {f.name: f.default for f in dataclasses.fields(TrainConfig)} | made_with
    for key, value in cfg.to_dict().items():
        if key not in RESUME_MAY_CHANGE and value != made_with[key]:
            raise InputError(f"cannot resume from {path}: it was made with {key} = {made_with[key]}, this run has "
                             f"{value}; a resumed run keeps what shapes its training (leave out --{key}, or start "
                             "a new run in another --output_dir)")


def restore(accelerator: Accelerator, optimizer, scheduler, resume: Resume, cfg: TrainConfig, identity: dict,
            **schedule) -> dict:
    """Collective, after prepare: check the checkpoint against the run that was built (identity: launch, data and
    model; the schedule: total_steps, steps_per_epoch, batches_per_epoch) and every file against its record; take
    the output folder (checkpoint.claim_output_dir: nothing is written before it, nothing refused after it); load
    the checkpoint. Returns the position the loop starts from; a fresh run's is step 0."""
    if resume.checkpoint is None:
        checkpoint.claim_output_dir(accelerator, cfg.output_dir, cfg.resume, cfg.overwrite_output_dir, None)
        return resume.position
    path, position = resume.checkpoint, resume.position
    checkpoint.check_compatible(path, position, identity, cfg.allow_pickle)
    best = position.get("best")
    if best and cfg.load_best_model_at_end:
        from .cadence import find_best_checkpoint

        find_best_checkpoint(best, cfg.output_dir)  # not at the end: the run could not export it
    checkpoint.check_resume(accelerator, path, position, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                            **schedule)
    if position["step"] == schedule["total_steps"]:
        accelerator.print(f"{path} is the end of this run (step {position['step']}): nothing left to train; "
                          "evaluating and exporting it again. To train longer, pass a larger --max_steps or "
                          "--num_train_epochs")
    checkpoint.claim_output_dir(accelerator, cfg.output_dir, cfg.resume, cfg.overwrite_output_dir, path)
    checkpoint.load_state(accelerator, optimizer, scheduler, path, cfg.output_dir, resume.universal)
    accelerator.print(f"resumed from {path} at optimizer step {position['step']}")
    return position
