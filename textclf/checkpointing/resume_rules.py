"""What a resume keeps and what it lets change, per key of what a checkpoint records (RESUME_TABLE): refused where
this run would be another run, made up for where the number of processes changed (resplit.py).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from textclf.config import RESUME_MAY_CHANGE, TrainConfig
from textclf.errors import InputError

from .folders import FSDP_SHARDED
from .resplit import batch_split, processes

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
