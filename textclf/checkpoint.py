"""Checkpoints: atomic `step_<N>/` folders that describe themselves, `latest`, rotation, resume checks.

A checkpoint is what `accelerator.save_state` writes plus `position.json`: the loop position
(optimizer step, epoch, batches consumed in that epoch), what the run was made with (world size,
gradient accumulation, micro batch, model, data fingerprint), its evaluation, and the resolved
config. `position.json` is written last, inside a temporary folder that is then renamed, so a
`step_<N>/` folder either is complete or does not exist.
"""

import json
import os
import re
import shutil
from typing import Optional

from accelerate import Accelerator
from accelerate.utils.constants import FSDP_MODEL_NAME

from .errors import InputError

POSITION = "position.json"
# Where accelerate's save_state puts FSDP's sharded model state: a torch.distributed.checkpoint folder,
# whose metadata file torch reads with full pickle.
FSDP_SHARDED = f"{FSDP_MODEL_NAME}_0"
STEP_DIR = re.compile(r"^step_(\d+)$")
# What must match between a checkpoint and the run resuming it, and how to say it.
IDENTITY = {
    "world_size": "number of processes",
    "zero_stage": "DeepSpeed ZeRO stage",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "per_device_train_batch_size": "per_device_train_batch_size",
    "model": "model",
    "lora": "lora",
    "data_fingerprint": "training data",
}


def identity(cfg, run: dict, data_fingerprint: str) -> dict:
    """This run's value of each IDENTITY key: from the launch (`run`, as runtime.describe says it), the
    training data, or the config."""
    launch = {"world_size": run["num_processes"], "zero_stage": run["zero_stage"], "data_fingerprint": data_fingerprint}
    return {key: launch[key] if key in launch else getattr(cfg, key) for key in IDENTITY}


def write_json(path: str, obj) -> None:
    """Write through a temporary file and a rename, so readers never see half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_position(checkpoint: str) -> dict:
    path = os.path.join(checkpoint, POSITION)
    if not os.path.isdir(checkpoint):
        raise InputError(f"checkpoint not found: {checkpoint}")
    if not os.path.isfile(path):
        raise InputError(f"{checkpoint} is not a complete checkpoint: it has no {POSITION} "
                         "(expected a step_<N>/ folder written by train.py)")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{path} is unreadable: {e}") from None


def complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in output_dir, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = STEP_DIR.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isfile(os.path.join(path, POSITION)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def find_resume_checkpoint(resume: Optional[str], output_dir: str, overwrite: bool) -> Optional[str]:
    """The checkpoint to resume from, or None to start fresh; refuses to mix runs in one folder."""
    existing = complete_checkpoints(output_dir)
    if resume == "latest":
        if not existing:
            raise InputError(f"--resume latest: no complete checkpoint in {output_dir}; "
                             "drop --resume to start a fresh run")
        return existing[-1][1]
    if resume:
        return resume
    if existing and not overwrite:
        raise InputError(f"{output_dir} already holds checkpoints (newest {existing[-1][1]}); pass --resume latest "
                         "to continue that run, or --overwrite_output_dir to start over")
    return None


def check_compatible(checkpoint: str, position: dict, identity: dict, allow_pickle: bool) -> None:
    """Stop when the checkpoint was made by a run that differs in a way resume cannot bridge, or
    when loading it would unpickle arbitrary objects without the user's say-so.

    Accelerate reads its own files (optimizer, scheduler, RNG states) with `weights_only=True` and
    the model from safetensors; DeepSpeed reads its partition files with full pickle, and
    torch.distributed.checkpoint (FSDP's sharded state) its metadata.
    """
    for key, what in IDENTITY.items():
        if position.get(key) != identity[key]:
            raise InputError(f"cannot resume from {checkpoint}: it was made with {what} = {position.get(key)}, "
                             f"this run has {identity[key]}; resume with the same settings")
    writer = "DeepSpeed" if position.get("zero_stage") is not None else \
        "FSDP" if os.path.isdir(os.path.join(checkpoint, FSDP_SHARDED)) else None
    if writer and not allow_pickle:
        raise InputError(f"{checkpoint} was written by {writer}, whose files load only with full pickle, which "
                         "can run code stored in them; pass --allow_pickle if you trust this checkpoint")


def save_checkpoint(accelerator: Accelerator, output_dir: str, position: dict, save_extra) -> str:
    """Collective: every rank calls it. Returns the checkpoint path."""
    final = os.path.join(output_dir, f"step_{position['step']}")
    tmp = os.path.join(output_dir, f".incomplete_step_{position['step']}")
    if accelerator.is_main_process and os.path.exists(tmp):
        shutil.rmtree(tmp)  # left by a run killed while saving
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()  # every rank writes its own files (RNG states, ZeRO shards) into tmp
    if accelerator.is_main_process:
        save_extra(tmp)
        write_json(os.path.join(tmp, POSITION), position)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


def rotate(output_dir: str, keep: int, metric: str, protect: Optional[str],
           greater_is_better: bool = True) -> list[str]:
    """Delete all but the `keep` newest checkpoints, the best one by `metric` (the task says which way is
    better: textclf/task.py), and `protect`."""
    found = complete_checkpoints(output_dir)
    kept = {path for _, path in found[-keep:]}
    scored = [(read_position(path).get("metrics", {}).get(metric), step, path) for step, path in found]
    scored = [(value if greater_is_better else -value, step, path) for value, step, path in scored if value is not None]
    if scored:
        kept.add(max(scored)[2])  # ties go to the newer checkpoint
    if protect:
        kept.add(os.path.abspath(protect))
        kept |= {path for _, path in found if os.path.abspath(path) == os.path.abspath(protect)}
    removed = [path for _, path in found if path not in kept]
    for path in removed:
        shutil.rmtree(path)
    return removed
