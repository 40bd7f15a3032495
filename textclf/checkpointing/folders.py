"""Where checkpoints are, and which one a run continues: the `step_<N>/` folders of an output folder, which of them
are complete (they hold position.json, written last), the names of what a killed run leaves; the checkpoint
`--resume <path>` names, the newest complete one (`latest`, and `auto`, which starts afresh where there is none), or
none (a fresh run, refused where the folder holds another run's checkpoints); and the best checkpoint the run keeps,
wherever the folder has moved.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from typing import Optional

from textclf import files
from textclf.config import RESUME_MAY_CHANGE, TrainConfig
from textclf.errors import InputError, write_failed
from textclf.launch import launch_environment

POSITION = "position.json"

# Where accelerate's save_state puts FSDP's sharded model state (f"{FSDP_MODEL_NAME}_0"; test_users checks it):
# a torch.distributed.checkpoint folder, whose metadata file torch reads with full pickle.
FSDP_SHARDED = "pytorch_model_fsdp_0"

STEP_DIR = re.compile(r"^step_(\d+)$")

INCOMPLETE = ".incomplete_"  # + step_<N>: a checkpoint being written

DELETING = ".deleting_"  # + step_<N>: a checkpoint being deleted

UNIVERSAL = ".universal_"  # + step_<N>: a ZeRO checkpoint converted for another number of processes

# What runs killed while saving, deleting or converting a checkpoint leave: the next run that claims the folder
# removes it.
LEFTOVERS = (INCOMPLETE, DELETING, UNIVERSAL)

LOCK = ".lock"  # held (flock) by the main process of the run that owns the folder


def delete_folder(path: str) -> None:
    """Delete a checkpoint folder: renamed to .deleting_<name>, then removed."""
    parent, name = os.path.split(os.path.normpath(path))
    doomed = os.path.join(parent, DELETING + name)
    try:  # a link in place of a checkpoint is removed as a link, never walked into
        with contextlib.suppress(OSError):
            files.remove(doomed)
        os.rename(path, doomed)
        files.remove(doomed)
    except OSError as e:
        raise write_failed("delete the checkpoint", path, e, f"make the folder writable (what is left of it is "
                           f"{doomed}, which the next start removes), then continue with --resume latest") from None


def checkpoint_folder(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"step_{step}")


def step_folders(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every step_<N> folder in output_dir, oldest first."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return sorted((int(match.group(1)), os.path.join(output_dir, name))
                  for name in names if (match := STEP_DIR.match(name)))


def complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in output_dir, oldest first."""
    return [(step, path) for step, path in step_folders(output_dir) if os.path.isfile(os.path.join(path, POSITION))]


def run_folder(cfg: TrainConfig) -> str:
    """The folder the run goes on in: --output_dir, or, for `--resume <path>` without one, the checkpoint's own."""
    resume = resolved_checkpoint(cfg.resume)
    if resume not in (None, "latest", "auto") and cfg.output_dir == TrainConfig.output_dir:
        return os.path.dirname(os.path.normpath(resume)) or "."
    return cfg.output_dir


def find_checkpoint(cfg: TrainConfig) -> Optional[str]:
    """The checkpoint that --resume names, or None for a fresh run; refuses to mix runs in one folder."""
    return find_resume_checkpoint(resolved_checkpoint(cfg.resume), run_folder(cfg), cfg.overwrite_output_dir, cfg)


def find_resume_checkpoint(resume: Optional[str], output_dir: str, overwrite: bool,
                           cfg: Optional[TrainConfig] = None) -> Optional[str]:
    """find_checkpoint's choice in `output_dir`, said where `--resume latest` passes over a lost checkpoint."""
    path = choose_checkpoint(resume, output_dir, overwrite, cfg)
    if resume == "latest":
        warn_of_lost_positions(output_dir, path)
    return path


def resolved_checkpoint(resume: Optional[str]) -> Optional[str]:
    """--resume <path> with the links on its way resolved, where it has any (else as given, as messages name it):
    a run resumed through a link goes on in the checkpoint's real folder, and locks that one."""
    if resume in (None, "latest", "auto"):
        return resume
    real = os.path.realpath(resume)
    return real if real != os.path.abspath(resume) else resume


def choose_checkpoint(resume: Optional[str], output_dir: str, overwrite: bool,
                      cfg: Optional[TrainConfig] = None) -> Optional[str]:
    """The checkpoint of `output_dir` that `resume` names (find_checkpoint; made again under the output folder's
    lock, claim_output_dir). A fresh run into a folder that holds checkpoints is refused, with the advice that fits:
    `--resume latest` where the newest was made with this run's config (`cfg`), another folder where it was not."""
    existing = complete_checkpoints(output_dir)
    if resume not in (None, "auto"):
        return named_checkpoint(resume, output_dir, overwrite, existing)
    if resume == "auto":  # one command that starts a run and continues it (a requeued job reruns its command)
        return existing[-1][1] if existing else None
    if existing and not overwrite:
        newest = existing[-1][1]
        other = differs_from(newest, cfg) if cfg is not None else None
        if other:
            raise InputError(f"{output_dir} already holds checkpoints of another run (newest {newest}, made with "
                             f"{other}); choose another --output_dir, or pass --overwrite_output_dir to move that "
                             "run aside")
        raise InputError(f"{output_dir} already holds checkpoints (newest {newest}); pass --resume latest to continue "
                         "that run, or --overwrite_output_dir to start over")
    return None


def differs_from(checkpoint: str, cfg: TrainConfig) -> Optional[str]:
    """How the config `checkpoint` was made with differs from `cfg` in what a resume would refuse to change (the first
    such field, as `<field> = <its value>, this run has <value>`), or None: `--resume latest` would continue it. A
    position.json that does not read, or records no config, says nothing either way (None)."""
    try:
        with open(os.path.join(checkpoint, POSITION), encoding="utf-8") as f:
            made_with = json.load(f).get("config")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(made_with, dict):
        return None
    ignored = {*RESUME_MAY_CHANGE, "resume", "overwrite_output_dir", "output_dir"}
    for key, value in cfg.to_dict().items():
        if key not in ignored and key in made_with and made_with[key] != value:
            return f"{key} = {made_with[key]}, this run has {value}"
    return None


def named_checkpoint(resume: str, output_dir: str, overwrite: bool, existing: list[tuple[int, str]]) -> str:
    """The checkpoint --resume latest or --resume <path> names (choose_checkpoint; `existing`: the complete
    checkpoints of output_dir)."""
    if resume == "latest":
        newer = without_position(output_dir, existing[-1][0] if existing else -1)
        if not existing:
            raise InputError(f"--resume latest: no complete checkpoint in {output_dir}"
                             + (f" ({', '.join(newer)} without {POSITION})" if newer else "")
                             + "; drop --resume to start a fresh run")
        return existing[-1][1]
    later = later_checkpoints(output_dir, resume)
    if later and not overwrite:
        raise LaterCheckpoints(f"--resume {resume}: {output_dir} holds checkpoints after it ({', '.join(later)}), "
                               "which this run would write over; pass --overwrite_output_dir to move them aside, or "
                               "--output_dir <another folder> to keep both runs", resume)
    return resume


class LaterCheckpoints(InputError):
    """named_checkpoint's refusal of a checkpoint that later ones follow, which still names the checkpoint: the plan
    of its resume goes on (plan_start), to name its other refusals in the same launch."""

    def __init__(self, message: str, checkpoint: str):
        super().__init__(message)
        self.checkpoint = checkpoint


def warn_of_lost_positions(output_dir: str, latest: str) -> None:
    """--resume latest passes over newer step_<N> folders without position.json: say so, once, on the main process."""
    newer = without_position(output_dir, int(STEP_DIR.match(os.path.basename(latest))[1]))
    if newer and launch_environment().rank == 0:
        print(f"warning: {os.path.join(output_dir, newer[-1], POSITION)} is missing (a save always writes it, so "
              f"it was deleted or lost): {newer[-1]} is not a complete checkpoint, and --resume latest takes "
              f"{latest}", file=sys.stderr)


def later_checkpoints(output_dir: str, checkpoint: str) -> list[str]:
    """The step_<N> folders of output_dir after `checkpoint` (by its step_<N> name), oldest first: a run resumed
    from it saves at their steps again."""
    match = STEP_DIR.match(os.path.basename(os.path.normpath(checkpoint)))
    if not match:
        return []
    return [os.path.basename(path) for step, path in step_folders(output_dir) if step > int(match.group(1))]


def without_position(output_dir: str, newer_than: int) -> list[str]:
    """The step_<N> folders above step `newer_than` that have no position.json, oldest first: a save never
    leaves one (it writes into .incomplete_step_<N>/ and renames), so its position.json was deleted or lost."""
    return [os.path.basename(path) for step, path in step_folders(output_dir)
            if step > newer_than and not os.path.isfile(os.path.join(path, POSITION))]


def find_best_checkpoint(best: dict, output_dir: str) -> str:
    """The best checkpoint's folder: in the folder the run goes on in (which may have been moved), else where
    it was saved (a run resumed into another --output_dir)."""
    for folder in (checkpoint_folder(output_dir, best["step"]), best["checkpoint"]):
        if os.path.exists(os.path.join(folder, POSITION)):
            return folder
    raise InputError(f"the best checkpoint so far (step {best['step']}, saved as {best['checkpoint']}) is neither "
                     f"there nor in {output_dir}: put it back in either place, or leave out --load_best_model_at_end")
