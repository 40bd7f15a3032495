"""A resume loaded, once `accelerator.prepare` has built the run: the checkpoint checked against that run (launch,
data, model, schedule, every file as saved) before the run takes its output folder, its pickles read weights-only
while `accelerator.load_state` reads it, and afterwards what accelerate's load does not restore as an uninterrupted
run has it.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from typing import TYPE_CHECKING

from textclf.config import TrainConfig
from textclf.errors import InputError, checked_on_main_process

from .folders import POSITION, find_best_checkpoint
from .pickles import weights_only_loads
from .plan import Start
from .resplit import WINDOW_KEYS
from .resume_rules import check_against
from .verify import verify_files

if TYPE_CHECKING:
    from accelerate import Accelerator


def check_resume(accelerator: Accelerator, start: Start, cfg: TrainConfig, made_of: dict, **schedule) -> None:
    """Collective, after prepare and before the run takes its output folder (a refusal leaves nothing behind): the
    checkpoint `start` resumes is checked against the run that was built (`made_of`: what the run is made of, by
    RESUME_TABLE; the schedule: total_steps, steps_per_epoch, batches_per_epoch), its position against the schedule
    and every file against its record."""
    path, position = start.checkpoint, start.position
    check_against(path, position, made_of)
    best = position.get("best")
    if best and cfg.load_best_model_at_end:
        find_best_checkpoint(best, cfg.output_dir)  # not at the end: the run could not export it
    check_position(path, position, world_size=accelerator.num_processes,
                   gradient_accumulation_steps=cfg.gradient_accumulation_steps, **schedule)
    checked_on_main_process(accelerator, lambda: verify_files(path, position))
    if position["step"] == schedule["total_steps"]:
        accelerator.print(f"{path} is the end of this run (step {position['step']}): nothing left to train; "
                          "evaluating and exporting it again. To train longer, pass a larger --max_steps or "
                          "--num_train_epochs")


@contextmanager
def resuming(accelerator: Accelerator, optimizer, scheduler, start: Start, cfg: TrainConfig):
    """Collective, once check_resume has passed and the run holds its output folder: yields the folder
    `accelerator.load_state` must read to resume `start.checkpoint`, a universal copy where ZeRO's partitions change
    hands, its pickles read weights-only (pickles.weights_only_loads). After the load: the step the checkpoint's own
    scheduler and optimizer counted is checked against its position, and what accelerate's load does not restore as
    an uninterrupted run has it is put right."""
    path, position = start.checkpoint, start.position
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
