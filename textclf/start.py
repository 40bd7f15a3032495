"""Where a run starts: fresh, or from the checkpoint that --resume names.

A fresh run goes no further than this module. A resume is planned and restored by textclf/resume.py, imported only
then: what the checkpoint needs of this launch before the Accelerator exists, its checks and its load after prepare.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from . import checkpoint
from .config import TrainConfig

if TYPE_CHECKING:  # torch and accelerate are loaded after plan_start has run
    from accelerate import Accelerator

FRESH = {"step": 0, "epoch": 0, "batch_in_epoch": 0}
SPLIT = ("per_device_train_batch_size", "gradient_accumulation_steps")  # how a launch splits the global batch


@dataclass(frozen=True)
class Start:
    """Where a run starts: fresh (checkpoint None), or the checkpoint it continues."""

    checkpoint: Optional[str] = None
    position: dict = field(default_factory=lambda: dict(FRESH))
    """The loop position (and the loss window, the best evaluation), counted in this launch's batches."""
    universal: bool = False
    """ZeRO's states were partitioned over another number of processes: they load through DeepSpeed's universal
    checkpoint, which the Accelerator is told before prepare."""
    asked_split: dict = field(default_factory=dict)
    """The micro-batch and accumulation the run asked for, which its checkpoints record: a launch of another size
    splits the global batch otherwise, and the same command then resumes them again on any number of processes."""


def plan_start(cfg: TrainConfig, argv: Optional[list[str]] = None) -> tuple[TrainConfig, Start]:
    """The config this run trains with, and where it starts; before torch is imported. `argv`: the command line that
    made `cfg`, which a resume parses again over the checkpoint's config (resume.plan_resume)."""
    path = find_checkpoint(cfg)
    if path is None:
        return cfg, Start(asked_split={key: getattr(cfg, key) for key in SPLIT})
    from .resume import plan_resume

    return plan_resume(cfg, argv, path)


def find_checkpoint(cfg: TrainConfig) -> Optional[str]:
    """The checkpoint that --resume names, or None for a fresh run; refuses to mix runs in one folder."""
    output_dir = cfg.output_dir  # the folder the run goes on in: the one given, or a step_<N> path's own
    if cfg.resume not in (None, "latest", "auto") and output_dir == TrainConfig.output_dir:
        output_dir = os.path.dirname(os.path.normpath(cfg.resume)) or "."
    return checkpoint.find_resume_checkpoint(cfg.resume, output_dir, cfg.overwrite_output_dir)


def begin(accelerator: Accelerator, optimizer, scheduler, start: Start, cfg: TrainConfig, made: dict,
          **schedule) -> dict:
    """Collective, after prepare: the run takes its output folder, which nothing was written to before; a resume
    first checks its checkpoint against the run that was built (`made`: record's keys) and then loads it. Returns
    the position the loop starts from."""
    if start.checkpoint is None:
        checkpoint.claim_output_dir(accelerator, cfg.output_dir, cfg.resume, cfg.overwrite_output_dir, None)
        return start.position
    from .resume import restore

    return restore(accelerator, optimizer, scheduler, start, cfg, made, **schedule)


def record(cfg: TrainConfig, run: dict, data_fingerprint: str) -> dict:
    """What a checkpoint records of its run beside the config, from the launch (`run`: runtime.describe), the data
    and the config; resume.RESUME_TABLE says what a resume does with each key."""
    return {"world_size": run["num_processes"], "zero_stage": run["zero_stage"],
            "mixed_precision": run["mixed_precision"], "per_device_train_batch_size": cfg.per_device_train_batch_size,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "global_batch_size": run["global_batch_size"], "model": cfg.model, "lora": cfg.lora,
            "data_fingerprint": data_fingerprint}
