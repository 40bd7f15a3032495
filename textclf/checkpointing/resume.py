"""Resume, decided in one place: planned before the Accelerator exists, loaded once after `accelerator.prepare`, each
key of what the checkpoint records handled as RESUME_TABLE says.

`plan_start` runs before torch is imported, so a resume that this launch cannot continue is refused in a fraction of
a second. A fresh run ends there. For a resume, it lays the config the checkpoint was made with under the command
line's, refuses what would make it another run, and works out what the checkpoint needs of this launch: the gradient
accumulation that keeps its global batch, its loop position counted in this launch's batches, and whether ZeRO's
states go through a universal checkpoint. `resuming` (collective) checks the checkpoint against the run that was
built (launch, data, model, schedule, every file as saved) and yields the folder train.py's `accelerator.load_state`
reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from textclf.cli import parse_config
from textclf.config import PATH_FIELDS, RESUME_MAY_CHANGE, TrainConfig, field_names
from textclf.errors import InputError, checked_on_main_process, say
from textclf.launch import launch_environment, this_launch

from .folders import FSDP_SHARDED, POSITION, LaterCheckpoints, find_best_checkpoint
from .output_dir import claim_output_dir, find_checkpoint
from .pickles import refuse_pickle_unless_allowed, weights_only_loads
from .verify import STARTED_IN, authorship, read_verified_position, verified_folder, verify_files

if TYPE_CHECKING:
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
    started_in: str = field(default_factory=os.getcwd)
    """The folder this run started in, which its checkpoints record: their config's relative paths start there."""

    def verified_folder(self, name: str) -> Optional[str]:
        """The checkpoint's sub-folder `name` (the tokenizer it was trained with), once every file in it is the one
        its position.json recorded, before any is read; None for a fresh run."""
        return None if self.checkpoint is None else verified_folder(self.checkpoint, name)


def plan_start(cfg: TrainConfig, argv: Optional[list[str]] = None,
               refusals: Optional[list[str]] = None) -> tuple[TrainConfig, Start]:
    """The config this run trains with, and where it starts; before torch is imported. `argv`: the command line that
    made `cfg`, which a resume parses again over the checkpoint's config (plan_resume).

    A resume's refusals are named together, one line each of one InputError, so that one launch says all that must
    change, not one a launch; with `refusals` (the check command, which calls them conflicts) they are added there
    instead, and the plan goes on as far as it can. One the plan cannot go on after (the output folder in use, a
    position.json that is not the one saved) ends it at once, after those found before it."""
    gathered = [] if refusals is None else refusals
    try:
        path = find_checkpoint(cfg)
    except LaterCheckpoints as e:  # the checkpoint is still known: its own refusals are named with this one
        gathered.append(str(e))
        path = e.checkpoint
    if path is None:
        return cfg, Start(asked_split={key: getattr(cfg, key) for key in SPLIT})
    try:
        cfg, start, rescaled = plan_resume(cfg, argv, path, gathered)
    except InputError as e:
        if refusals is None and gathered:
            raise InputError("\n".join([*gathered, str(e)])) from None
        raise
    if refusals is None:
        if gathered:
            raise InputError("\n".join(gathered))
        if rescaled:
            say(rescaled)
    return cfg, start


# What a run stores of its loss window, per rank (the loss Window's state).
WINDOW_KEYS = {"loss_sum": (int, float), "losses": (int,), "samples": (int,), "real_tokens": (int,),
               "padded_tokens": (int,)}


def plan_resume(cfg: TrainConfig, argv: Optional[list[str]], path: str,
                refusals: list[str]) -> tuple[TrainConfig, Start, Optional[str]]:
    """The config a run resuming `path` trains with, where it starts, and the line that says how it keeps the
    checkpoint's global batch on another number of processes (or None). `argv`: the command line that made `cfg`,
    parsed again over the checkpoint's config (what it does not set comes from the checkpoint); without it, `cfg`
    (a config built in code) is taken as it is and must agree with the checkpoint. Each refusal known before torch
    is imported is added to `refusals` (once: check_against repeats batch_split's), and the plan goes on."""

    def unless_refused(check, *args):
        try:
            return check(*args)
        except InputError as e:
            for line in str(e).splitlines():
                if line not in refusals:
                    refusals.append(line)
            return None

    position = read_verified_position(path)
    if launch_environment().rank == 0:  # who wrote it: judged where the secret is, which the main process has
        unproven = authorship(path, position)  # an edit ends the plan here
        unless_refused(refuse_pickle_unless_allowed, path, unproven, cfg.allow_pickle)
    position = seen_from_here(position)
    made_with = config_of(path, position)
    if made_with is not None and argv is not None:
        cfg = parse_config(argv, under=made_with)
    unless_refused(check_against, path, position, {"config": cfg.to_dict()})
    asked = {key: getattr(cfg, key) for key in SPLIT}
    launch = this_launch(cfg.mixed_precision)
    world_size = launch["num_processes"]
    split = unless_refused(batch_split, path, position, world_size)  # it refuses a checkpoint older than the record
    rescaled = unless_refused(check_against, path, position, {
        "world_size": world_size, "zero_stage": launch["zero_stage"], "mixed_precision": launch["mixed_precision"],
        "distributed_type": "FSDP" if launch_environment().fsdp else None})
    universal = unless_refused(needs_universal, path, position, world_size, cfg.load_best_model_at_end)
    # What `resuming` would refuse once the run is built, known now.
    if position.get("best") and cfg.load_best_model_at_end:  # not at the end: the run could not export it
        unless_refused(find_best_checkpoint, position["best"], cfg.output_dir)
    cfg = dataclasses.replace(cfg, **(split or {}))
    return cfg, Start(
        checkpoint=path, asked_split=asked, universal=bool(universal),
        position=on_this_launch(position, world_size, cfg.gradient_accumulation_steps,
                                cfg.per_device_train_batch_size)), rescaled


def resolve(cfg: TrainConfig, argv: Optional[list[str]] = None) -> tuple[Optional[str], dict, TrainConfig]:
    """The checkpoint that --resume names (None: a fresh run), its position as saved, and the config the run
    trains with (for the check command, which resumes as train.py does)."""
    path = find_checkpoint(cfg)
    if path is None:
        return None, dict(FRESH), cfg
    return (path, *config_for(cfg, argv, path))


def config_for(cfg: TrainConfig, argv: Optional[list[str]], path: str) -> tuple[dict, TrainConfig]:
    """The checkpoint's position as saved, and the config a run resuming it trains with (plan_resume's `argv`)."""
    position = read_verified_position(path)
    made_with = config_of(path, position)
    if made_with is not None and argv is not None:
        cfg = parse_config(argv, under=made_with)
    check_against(path, position, {"config": cfg.to_dict()})
    return position, cfg


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


@contextmanager
def resuming(accelerator: Accelerator, optimizer, scheduler, start: Start, cfg: TrainConfig, made_of: dict,
             **schedule):
    """Collective, after prepare: yields the folder `accelerator.load_state` must read to resume `start.checkpoint`.

    Before: the checkpoint is checked against the run that was built (`made_of`: what the run is made of, by
    RESUME_TABLE; the schedule: total_steps, steps_per_epoch, batches_per_epoch) and every file against its record;
    the run takes its output folder (nothing is refused after it); where ZeRO's partitions change hands, the folder
    is a universal copy. After: what accelerate's load does not restore as an uninterrupted run has it. A pickle
    that load_state refuses is one line.
    """
    path, position = start.checkpoint, start.position
    check_against(path, position, made_of)
    best = position.get("best")
    if best and cfg.load_best_model_at_end:
        find_best_checkpoint(best, cfg.output_dir)  # not at the end: the run could not export it
    check_resume(accelerator, path, position, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                 **schedule)
    if position["step"] == schedule["total_steps"]:
        accelerator.print(f"{path} is the end of this run (step {position['step']}): nothing left to train; "
                          "evaluating and exporting it again. To train longer, pass a larger --max_steps or "
                          "--num_train_epochs")
    claim_output_dir(accelerator, cfg.output_dir, cfg.resume, cfg.overwrite_output_dir, path)
    folder, settings = path, None
    with weights_only_loads(path, deepspeed=position.get("zero_stage") is not None, allow_pickle=cfg.allow_pickle):
        if start.universal:
            from . import universal  # DeepSpeed's conversion: a launch without DeepSpeed never imports it

            folder = universal.universal_copy(accelerator, path, cfg.output_dir)
            settings = universal.group_settings(optimizer)
        yield folder
    refuse_other_counts(path, position, scheduler, optimizer)
    # load_state also restores accelerate's micro-batch counter, which decides where gradients sync; it counts in
    # the saved accumulation, and a checkpoint always sits where they synced: zero, in any accumulation's units.
    accelerator.step = 0
    if start.universal:
        universal.after_universal_load(accelerator, optimizer, folder, settings)
    schedule_the_optimizer_that_steps(scheduler, optimizer)
    replay_cpu_adam_steps(optimizer)  # DeepSpeed's CPU Adam (offload) then steps as if never stopped
    accelerator.print(f"resumed from {path} at optimizer step {position['step']}")


def check_position(checkpoint: str, position: dict, *, total_steps: int, steps_per_epoch: int,
                   batches_per_epoch: int, gradient_accumulation_steps: int, world_size: int) -> None:
    """The loop position must be one this run's schedule passes through: one line per violation.

    Within an epoch the optimizer steps after every `gradient_accumulation_steps` batches and after the
    epoch's last one, so a checkpoint taken after `batch_in_epoch` batches of epoch `epoch` is at step
    epoch * steps_per_epoch + ceil(batch_in_epoch / gradient_accumulation_steps).
    """
    problems = []
    for key in ("step", "epoch", "batch_in_epoch"):
        value = position.get(key)
        if type(value) is not int or value < 0:  # bool is an int to Python, not to a loop position
            problems.append(f"{key} is {json.dumps(value)}, expected a whole number >= 0")
    if not problems:
        step, epoch, batch = position["step"], position["epoch"], position["batch_in_epoch"]
        if step > total_steps:
            problems.append(f"step is {step}, past the end of this run at step {total_steps} "
                            "(--max_steps, or --num_train_epochs)")
        if not 1 <= batch <= batches_per_epoch:
            problems.append(f"batch_in_epoch is {batch}, outside this run's epoch of {batches_per_epoch} "
                            "batches per process")
        elif step != epoch * steps_per_epoch + math.ceil(batch / gradient_accumulation_steps):
            problems.append(f"step {step} is not where epoch {epoch}, batch {batch} of this run's schedule "
                            f"({steps_per_epoch} optimizer steps per epoch) is")
    windows = position.get("loss_window")
    if "loss_window" not in position:
        problems.append("it has no loss_window (written by an older textclf)")
    elif not (isinstance(windows, list) and len(windows) == world_size and all(
            isinstance(w, dict) and all(type(w.get(key)) in types for key, types in WINDOW_KEYS.items())
            for w in windows)):
        problems.append(f"loss_window is not one loss window ({', '.join(WINDOW_KEYS)}) per process "
                        f"({world_size})")
    if problems:
        raise InputError("\n".join(f"cannot resume from {checkpoint}: {POSITION}: {problem}; resume from another "
                                   "checkpoint" for problem in problems))


def check_resume(accelerator: Accelerator, checkpoint: str, position: dict, **schedule) -> None:
    """Before any step runs (collective): the position is one this run's schedule passes through
    (check_position), and every file is the one saved (verify_files, read by the main process alone)."""
    check_position(checkpoint, position, world_size=accelerator.num_processes, **schedule)
    checked_on_main_process(accelerator, lambda: verify_files(checkpoint, position))


def refuse_other_counts(checkpoint: str, position: dict, scheduler, optimizer) -> None:
    """The step position.json records is the one the checkpoint's own scheduler and optimizer counted, once loaded
    and before any step: a position moved without them would train on from another place than its states. The
    optimizer may count fewer where fp16's loss scaler skipped steps. Every rank checks its own and refuses alike
    (the scheduler is the same on each; each rank's ZeRO partition counts the same steps)."""
    step = position["step"]
    scheduled = getattr(scheduler, "scheduler", scheduler).last_epoch
    stepped = [int(state["step"]) for state in innermost_optimizer(optimizer).state.values() if "step" in state]
    counts = []
    if scheduled != step:
        counts.append(f"its scheduler has stepped {scheduled} times")
    if stepped and (max(stepped) > step or max(stepped) < step and position.get("mixed_precision") != "fp16"):
        counts.append(f"its optimizer has taken {max(stepped)} steps")
    if counts:
        raise InputError(f"cannot resume from {checkpoint}: its {POSITION} says step {step}, but {' and '.join(counts)}"
                         ": the position was edited, or its files come from different checkpoints; resume from "
                         "another checkpoint")


def innermost_optimizer(optimizer):
    """The optimizer that updates the weights: under accelerate's wrapper and DeepSpeed's ZeRO optimizer, the one
    ZeRO steps (DeepSpeedCPUAdam where the launch offloads the optimizer)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def schedule_the_optimizer_that_steps(scheduler, optimizer) -> None:
    """Point the learning-rate schedule at the optimizer that steps, after a load.

    Under offload_optimizer, accelerate swaps DeepSpeedCPUAdam in for the optimizer train.py built, and the two
    share their param group dicts, which is how the schedule (built on train.py's optimizer) reaches the one that
    steps. Loading a checkpoint replaces the stepping optimizer's group dicts (torch's load_state_dict makes new
    ones), so the schedule would go on setting learning rates that nothing reads, and training would go on at the
    checkpoint's rate.
    """
    schedule = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper, then torch's LambdaLR
    stepping = innermost_optimizer(optimizer)
    if schedule.optimizer is not stepping:
        schedule.optimizer = stepping


def replay_cpu_adam_steps(optimizer) -> None:
    """Bring DeepSpeed's CPU Adam (the offload files' optimizer) to the resumed step the way it got there.

    Its C++ side keeps Adam's bias corrections beta^t as a running product, multiplied by beta at each step, and
    computes them as pow(beta, t) when a step does not follow the last one it saw (csrc/includes/cpu_adam.h,
    IncrementStep): a resumed run's first step. The two differ in their last bits, and so would every weight after.
    Its steps up to the checkpoint's are replayed here on a one-element tensor of its own, which builds the same
    running product; the model's weights and states are not touched. Other optimizers keep no such state.
    """
    import torch

    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return
    optimizer = innermost_optimizer(optimizer)
    if not isinstance(optimizer, DeepSpeedCPUAdam) or not optimizer.state:
        return
    steps = max((int(state["step"]) for state in optimizer.state.values() if "step" in state), default=0)
    group = optimizer.param_groups[0]
    scratch = [torch.zeros(1) for _ in range(4)]  # weight, gradient and Adam's two moments
    for step in range(1, steps + 1):
        optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, group["lr"], *group["betas"], group["eps"],
                                          group["weight_decay"], group["bias_correction"], *scratch)


# What a resume does with each key a checkpoint records (position.json) when this run's value differs. check_against
# applies the MATCH rows and the config's as they stand; the RESHARD and RESCALE rows name what it does for another
# number of processes (batch_split, needs_universal).
MATCH = "match"  # refused: it would be another run

RESCALE = "rescale"  # made up with gradient accumulation, keeping the global batch (batch_split)

RESHARD = "reshard"  # ZeRO's states go through DeepSpeed's universal checkpoint (needs_universal); FSDP's are refused

FIELDS = "fields"  # each config field: refused, but for the fields marked MAY_CHANGE_ON_RESUME

# When this run's value is first known: from the command line and the launch, before torch is imported
# (plan_resume), or from the run built (resuming), which compares every key again with what it now knows for sure.
LAUNCH, BUILT = "launch", "built"


@dataclass(frozen=True)
class OnResume:
    action: str
    what: str  # how a refusal names it
    known: str


RESUME_TABLE = {
    "config": OnResume(FIELDS, "config", LAUNCH),
    "zero_stage": OnResume(MATCH, "DeepSpeed ZeRO stage", LAUNCH),
    "mixed_precision": OnResume(MATCH, "precision (mixed_precision)", LAUNCH),
    "world_size": OnResume(RESHARD, "processes", LAUNCH),
    # How a launch splits the global batch: the data order depends on neither (EpochLengthGroupedSampler).
    "per_device_train_batch_size": OnResume(RESCALE, "micro-batch", LAUNCH),
    "gradient_accumulation_steps": OnResume(RESCALE, "gradient accumulation", LAUNCH),
    "global_batch_size": OnResume(MATCH, "global batch (micro-batch x processes x accumulation)", BUILT),
    "model": OnResume(MATCH, "model", BUILT),
    "lora": OnResume(MATCH, "lora", BUILT),
    "data_fingerprint": OnResume(MATCH, "training data", BUILT),
}


def check_against(path: str, position: dict, this: dict) -> Optional[str]:
    """Refuse, in one line, what makes this run another run than the checkpoint's, by RESUME_TABLE: `this` holds this
    run's value of the keys known by now (the check command passes the launch's alone). Returns the line that says
    how the global batch is kept on another number of processes, or None."""
    if "config" in this and position.get("config") is not None:  # older checkpoints hold none: flags given again
        refuse_config_changes(path, position["config"], this["config"])
    differ = [key for key, rule in RESUME_TABLE.items() if rule.action == MATCH and key in this
              and position.get(key) != this[key]]
    made_on, world = position.get("world_size"), this.get("world_size", position.get("world_size"))
    resharded_fsdp = made_on != world and (this.get("distributed_type") == "FSDP"
                                           or os.path.isdir(os.path.join(path, FSDP_SHARDED)))
    at_launch = [f"{RESUME_TABLE[key].what} {position.get(key)} (this launch: {this[key]})" for key in differ
                 if RESUME_TABLE[key].known == LAUNCH]
    at_launch += [f"FSDP on {processes(made_on)} (this launch: {world}), whose sharded states this textclf does not "
                  "reshard"] if resharded_fsdp else []
    if at_launch:
        raise InputError(f"cannot resume from {path}: it was made by a launch with {', '.join(at_launch)}; resume it "
                         f"with {launch_for(position)} --resume {path}")
    if differ:
        key = differ[0]
        raise InputError(f"cannot resume from {path}: it was made with {RESUME_TABLE[key].what} = "
                         f"{position.get(key)}, this run has {this[key]}; resume with the same settings")
    if made_on == world:
        return None
    split = batch_split(path, position, world)
    # Another number of processes sums the gradients in another order; a micro-batch split in two also draws other
    # dropout masks. Either way the run goes on from the same example, but no longer bit for bit.
    not_bitwise = ("its dropout masks (micro-batches split) and the order gradients are summed in differ, so from here "
                   "it matches the uninterrupted run closely, not bit for bit"
                   if split["per_device_train_batch_size"] < position["per_device_train_batch_size"] else
                   "the order gradients are summed in differs, so from here it matches the uninterrupted run to "
                   "rounding, not bit for bit")
    return (f"resuming {path}, made by {processes(made_on)} with micro-batch {position['per_device_train_batch_size']} "
            f"and gradient accumulation {position.get('gradient_accumulation_steps')}, on {processes(world)}: "
            f"micro-batch {split['per_device_train_batch_size']} and gradient accumulation "
            f"{split['gradient_accumulation_steps']} keep its global batch of {position['global_batch_size']}; "
            f"{not_bitwise}")


def refuse_config_changes(path: str, made_with: dict, config: dict) -> None:
    """The config row of RESUME_TABLE: a field not marked MAY_CHANGE_ON_RESUME keeps the checkpoint's value."""
    made_with = {f.name: f.default for f in dataclasses.fields(TrainConfig)} | made_with  # newer options: defaults
    for key, value in config.items():
        if key not in RESUME_MAY_CHANGE and value != made_with[key]:
            raise InputError(f"cannot resume from {path}: it was made with {key} = {made_with[key]}, this run has "
                             f"{value}; a resumed run keeps what shapes its training (leave out --{key}, or start "
                             "a new run in another --output_dir)")


def processes(n) -> str:
    return f"{n} process{'es' * (n != 1)}"


def batch_split(checkpoint: str, position: dict, world_size: int) -> dict:
    """The micro-batch and gradient accumulation that make up the checkpoint's global batch on `world_size`
    processes (per_device_train_batch_size, gradient_accumulation_steps): the micro-batch its run asked for with
    another accumulation where that divides, else the largest smaller micro-batch that does (on more processes
    than it has micro-batches). Refused in one line, with the numbers of processes that can, when none does. No
    torch: it runs before the launch's Accelerator is made, which takes the accumulation."""
    total, made = position.get("global_batch_size"), position.get("per_device_train_batch_size")
    if not (isinstance(total, int) and isinstance(made, int) and made > 0):
        raise InputError(f"cannot resume from {checkpoint}: it was made by an older textclf, whose data order "
                         "depended on the number of processes; resume it with the textclf that made it, or start "
                         "a new run")
    # The micro-batch asked for is in the checkpoint's config: a resume on more processes may have made it smaller.
    asked = (position.get("config") or {}).get("per_device_train_batch_size")
    asked = asked if isinstance(asked, int) and asked > 0 else made
    micro = next((size for size in range(min(asked, total // world_size), 0, -1)
                  if total % (size * world_size) == 0), None)
    if micro is None:
        fits = [n for n in range(1, total + 1) if total % n == 0]
        raise InputError(f"cannot resume from {checkpoint} on {processes(world_size)}: its global batch of {total} "
                         f"({processes(position.get('world_size'))} x micro-batch {made} x accumulation "
                         f"{position.get('gradient_accumulation_steps')}) does not split into equal micro-batches "
                         f"over {processes(world_size)}; resume it on {', '.join(map(str, fits))} processes "
                         f"(accelerate launch --num_processes N ... train.py --resume {checkpoint})")
    return {"per_device_train_batch_size": micro, "gradient_accumulation_steps": total // (micro * world_size)}


def on_this_launch(position: dict, world_size: int, gradient_accumulation_steps: int,
                   micro_batch: Optional[int] = None) -> dict:
    """The position as this launch counts it: batches per process into the epoch, and the loss window split
    evenly over this launch's processes in micro-batches of `micro_batch` (by default the checkpoint's): a
    checkpoint sits where gradients sync, so all of them divide exactly."""
    made_on, made_with = position.get("world_size"), position.get("gradient_accumulation_steps")
    made_micro = position.get("per_device_train_batch_size")
    micro_batch = micro_batch or made_micro
    if made_on == world_size and micro_batch == made_micro:
        return position
    windows = position.get("loss_window")
    if isinstance(windows, list) and all(isinstance(w, dict) for w in windows) and \
            all(type(w.get(key)) in types for w in windows for key, types in WINDOW_KEYS.items()) and \
            isinstance(made_micro, int) and made_micro > 0:
        totals = {key: sum(w[key] for w in windows) for key in WINDOW_KEYS}
        # A loss is one micro-batch's mean: a micro-batch split in two is two losses of the same mean.
        totals |= {"loss_sum": totals["loss_sum"] * made_micro / micro_batch,
                   "losses": totals["losses"] * made_micro // micro_batch}
        windows = [{"loss_sum": totals["loss_sum"] / world_size, "losses": totals["losses"] // world_size,
                    **{key: totals[key] // world_size + (totals[key] % world_size if rank == 0 else 0)
                       for key in ("samples", "real_tokens", "padded_tokens")}} for rank in range(world_size)]
    batch = position.get("batch_in_epoch")
    if type(batch) is int and isinstance(made_with, int) and made_with > 0:
        batch = batch // made_with * gradient_accumulation_steps
    return {**position, "batch_in_epoch": batch, "loss_window": windows}


def launch_for(position: dict) -> str:
    """The command line that starts a run of the checkpoint's launch (processes, ZeRO stage, precision)."""
    world, stage, precision = position.get("world_size", 1), position.get("zero_stage"), position.get("mixed_precision")
    if world == 1 and stage is None:
        return "python train.py" + (f" --mixed_precision {precision}" if precision not in (None, "no") else "")
    config = (f"accelerate_configs/zero{stage}.yaml (or its _offload variant)" if stage in (2, 3) else
              f"<a ZeRO-{stage} yaml>" if stage is not None else
              "accelerate_configs/cpu.yaml (ddp.yaml on GPUs)")
    return (f"accelerate launch --config_file {config} --num_processes {world} --mixed_precision {precision} "
            "train.py")


def needs_universal(checkpoint: str, position: dict, world_size: int, load_best_model_at_end: bool) -> bool:
    """Whether resuming this checkpoint on world_size processes goes through DeepSpeed's universal checkpoint:
    ZeRO partitions its optimizer state (and, at stage 3, the weights) over the processes that saved it.
    The best model's reload at the end loads checkpoints of both sizes into one engine, which is not offered."""
    universal = position.get("zero_stage") is not None and position.get("world_size") != world_size
    if universal and load_best_model_at_end:
        raise InputError(f"cannot resume {checkpoint} on {processes(world_size)} with --load_best_model_at_end: its "
                         f"ZeRO states were saved by {processes(position.get('world_size'))}, and the best model's "
                         "reload would mix checkpoints of both; resume it on as many processes as made it, or with "
                         "--load_best_model_at_end false")
    return universal
