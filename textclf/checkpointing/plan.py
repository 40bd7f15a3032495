"""Where a run starts, planned before torch is imported: fresh, or the checkpoint --resume names. A resume is read
first (read_resume: the checkpoint found, its position.json verified, who wrote it judged, its config as this folder
sees it); the command line is parsed over that config, by the caller; then plan_start refuses what
would make it another run and works out what the checkpoint needs of this launch: the gradient accumulation that
keeps its global batch, its loop position counted in this launch's batches, and whether ZeRO's states go through a
universal checkpoint. A resume that this launch cannot continue is refused in a fraction of a second.

A resume's refusals are gathered in one list, one line each, so that one launch says all that must change; one the
plan cannot go on after (the output folder in use, a position.json that is not the one saved) is raised at once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

from textclf.config import CONSENT_FIELDS, PATH_FIELDS, TrainConfig, field_names
from textclf.errors import InputError
from textclf.launch import launch_environment, this_launch

from .folders import LaterCheckpoints, find_best_checkpoint, find_checkpoint, run_folder
from .output_dir import refuse_moving_what_it_reads, refuse_unusable
from .pickles import refuse_pickle_unless_allowed
from .resplit import batch_split, needs_universal, on_this_launch
from .resume_rules import check_against
from .verify import authorship, read_verified_position, verified_folder
from .write import STARTED_IN

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
    resplit: Optional[str] = None
    """The line that says how a resume on another number of processes keeps its checkpoint's global batch."""
    started_in: str = field(default_factory=os.getcwd)
    """The folder this run started in, which its checkpoints record: their config's relative paths start there."""

    def verified_folder(self, name: str) -> Optional[str]:
        """The checkpoint's sub-folder `name` (the tokenizer it was trained with), once every file in it is the one
        its position.json recorded, before any is read; None for a fresh run."""
        return None if self.checkpoint is None else verified_folder(self.checkpoint, name)


@dataclass(frozen=True)
class Resumed:
    """What a resume reads of its checkpoint before the command line is parsed over it."""

    checkpoint: str
    position: dict
    """As saved, verified, its local paths as this folder reaches them (seen_from_here)."""
    made_with: Optional[dict]
    """The config the checkpoint was made with, as defaults for the resumed run (config_of); None for a checkpoint
    written before checkpoints held their config."""


def unless_refused(refusals: list[str], check, *args):
    """`check(*args)`, its refusal added to `refusals` (each line once) instead of raised; None then."""
    try:
        return check(*args)
    except InputError as e:
        for line in str(e).splitlines():
            if line not in refusals:
                refusals.append(line)
        return None


def read_resume(cfg: TrainConfig, refusals: list[str]) -> Optional[Resumed]:
    """The checkpoint --resume names, read before the command line is parsed over its config; None for a fresh run.
    Checkpoints after it (LaterCheckpoints) and pickles it may not load are added to `refusals`, and the plan goes
    on; a position.json that is not the one saved, or not what this user's run signed, ends it here."""
    output_dir = run_folder(cfg)
    refuse_unusable(output_dir)  # a file, or a folder another run holds: the plan cannot go on
    try:
        path = find_checkpoint(cfg)
    except LaterCheckpoints as e:  # the checkpoint is still known: its own refusals are named with this one
        refusals.append(str(e))
        path = e.checkpoint
    if cfg.overwrite_output_dir:
        refuse_moving_what_it_reads(cfg, output_dir, path)
    if path is None:
        return None
    position = read_verified_position(path)
    if launch_environment().rank == 0:  # who wrote it: judged where the secret is, which the main process has
        unproven = authorship(path, position)  # an edit ends the plan here
        unless_refused(refusals, refuse_pickle_unless_allowed, path, unproven, cfg.allow_pickle)
        unless_refused(refusals, refuse_unnamed_metrics, path, unproven, position, cfg.metric)
    position = seen_from_here(position)
    return Resumed(path, position, config_of(path, position))


def refuse_unnamed_metrics(checkpoint: str, unproven: Optional[str], position: dict, given: list[str]) -> None:
    """A metric module is code: those that a checkpoint from elsewhere (`unproven`: why nothing proves this user's run
    wrote it) names in its config run only where this command line names them (`given`, which replaces them)."""
    if unproven is None or given:  # a --metric given here replaces the checkpoint's list
        return
    named = (position.get("config") or {}).get("metric") or []
    if named:
        names = " ".join(map(str, named if isinstance(named, list) else [named]))
        raise InputError(f"{checkpoint} was written elsewhere ({unproven}), and its config names --metric {names}, "
                         "a module whose code the run would run; if you trust it, name it here too: --metric "
                         f"{names} (or give the --metric modules to run instead)")


def plan_start(cfg: TrainConfig, resumed: Optional[Resumed], refusals: list[str]) -> tuple[TrainConfig, Start]:
    """The config a run trains with and where it starts: fresh, or resuming `resumed` (read_resume) with `cfg` the
    command line parsed over its config (or, built in code, taken as it is: it must agree with the checkpoint's).
    Each refusal known before torch is imported is added to `refusals` (once: check_against repeats batch_split's),
    and the plan goes on."""
    if resumed is None:
        return cfg, Start(asked_split={key: getattr(cfg, key) for key in SPLIT})
    path, position = resumed.checkpoint, resumed.position

    def refused(check, *args):
        return unless_refused(refusals, check, *args)

    refused(check_against, path, position, {"config": cfg.to_dict()})
    asked = {key: getattr(cfg, key) for key in SPLIT}
    launch = this_launch(cfg.mixed_precision)
    world_size = launch["num_processes"]
    split = refused(batch_split, path, position, world_size)  # it refuses a checkpoint older than the record
    resplit = refused(check_against, path, position, {
        "world_size": world_size, "zero_stage": launch["zero_stage"], "mixed_precision": launch["mixed_precision"],
        "distributed_type": "FSDP" if launch_environment().fsdp else None})
    universal = refused(needs_universal, path, position, world_size, cfg.load_best_model_at_end)
    # What check_resume would refuse once the run is built, known now.
    if position.get("best") and cfg.load_best_model_at_end:  # not at the end: the run could not export it
        refused(find_best_checkpoint, position["best"], cfg.output_dir)
    cfg = dataclasses.replace(cfg, **(split or {}))
    return cfg, Start(
        checkpoint=path, asked_split=asked, universal=bool(universal), resplit=resplit,
        position=on_this_launch(position, world_size, cfg.gradient_accumulation_steps,
                                cfg.per_device_train_batch_size))


def seen_from_here(position: dict) -> dict:
    """`position` with the local paths of its config (PATH_FIELDS) and its model as this folder reaches them: a
    relative path starts from the folder its run started in, where it exists there, so that a resume from another
    folder reads the same files."""
    started_in = position.get(STARTED_IN)
    if not isinstance(started_in, str) or os.path.abspath(started_in) == os.getcwd():
        return position

    def rebased(value):
        if isinstance(value, str) and value and not os.path.isabs(value) and not value.startswith("~"):
            there = os.path.join(started_in, value)
            if os.path.exists(there):
                return there
        return value

    config = position.get("config")
    if isinstance(config, dict):
        config = {key: rebased(value) if key in PATH_FIELDS else value for key, value in config.items()}
    return {**position, "config": config, "model": rebased(position.get("model"))}


def config_of(path: str, position: dict) -> Optional[dict]:
    """The config the checkpoint was made with, as defaults for the resumed run: its output_dir becomes the
    folder that holds the checkpoint, so the run goes on where it was (even when the folder has moved); what only the
    user may allow (CONSENT_FIELDS: --allow_pickle, --trust_remote_code) comes from this command line alone. None
    for a checkpoint written before checkpoints held their config: every flag must then be given again."""
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
            "overwrite_output_dir": False, **{key: False for key in CONSENT_FIELDS}}
