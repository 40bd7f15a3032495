"""Checkpoints: atomic `step_<N>/` folders that describe themselves, `latest`, rotation, resume checks,
and the output folder that one run at a time owns.

A checkpoint is what `accelerator.save_state` writes plus `position.json`: the loop position
(optimizer step, epoch, batches consumed in that epoch), what the run was made with (world size,
gradient accumulation, micro batch, model, data fingerprint), its evaluation, the resolved config,
each rank's loss window (tracking.Window), the list of its files with their sizes and sha256, and a
sha256 of its own fields. `position.json` is written last, inside a temporary folder that is then
renamed, so a `step_<N>/` folder either is complete or does not exist. Whatever loads a checkpoint
(resume, the best model's reload, export, predict, report) first reads every file in full against
the list: a changed byte anywhere is refused, naming the file.

Folders are deleted through a rename (`.deleting_<name>`), so a kill mid-way never leaves a half
deleted folder that looks like a checkpoint. What a killed run leaves (`.incomplete_step_<N>`,
`.deleting_*`) is removed when the next run claims the folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # accelerate is imported where it is used: a resume is checked before torch loads (train.py)
    from accelerate import Accelerator

from .errors import PEER_ENDED, WRITE_ERRORS, InputError, checked_on_main_process, gist, peer_ended, write_failed

POSITION = "position.json"
# Where accelerate's save_state puts FSDP's sharded model state (f"{FSDP_MODEL_NAME}_0"; test_users checks it):
# a torch.distributed.checkpoint folder, whose metadata file torch reads with full pickle.
FSDP_SHARDED = "pytorch_model_fsdp_0"
STEP_DIR = re.compile(r"^step_(\d+)$")
INCOMPLETE = ".incomplete_"  # + step_<N>: a checkpoint being written
DELETING = ".deleting_"  # + step_<N>: a checkpoint being deleted
LOCK = ".lock"  # held (flock) by the main process of the run that owns the folder
# What a run stores of its loss window, per rank (tracking.Window.state).
WINDOW_KEYS = {"loss_sum": (int, float), "losses": (int,), "samples": (int,), "real_tokens": (int,),
               "padded_tokens": (int,)}
# What must match between a checkpoint and the run resuming it, and how to say it. The number of processes, the
# micro-batch and the accumulation may change (the data order depends on none of them:
# data.EpochLengthGroupedSampler), as long as they keep the global batch (batch_split).
IDENTITY = {
    "global_batch_size": "global batch (micro-batch x processes x accumulation)",
    "zero_stage": "DeepSpeed ZeRO stage",
    "mixed_precision": "precision (mixed_precision)",
    "model": "model",
    "lora": "lora",
    "data_fingerprint": "training data",
}
# Recorded with the identity, not compared: how the checkpoint's launch split its global batch.
SPLIT = ("world_size", "per_device_train_batch_size", "gradient_accumulation_steps")
_held_locks = []  # the open lock files of this process: closing one would release the folder
_warned = set()  # the step folders without position.json this process has warned of (choose_checkpoint runs twice)


def identity(cfg, run: dict, data_fingerprint: str) -> dict:
    """This run's value of each IDENTITY key: from the launch (`run`, as runtime.describe says it), the
    training data, or the config."""
    launch = {"world_size": run["num_processes"], "zero_stage": run["zero_stage"],
              "mixed_precision": run["mixed_precision"], "data_fingerprint": data_fingerprint,
              "global_batch_size": run["global_batch_size"]}
    return {key: launch[key] if key in launch else getattr(cfg, key) for key in (*IDENTITY, *SPLIT)}


def write_json(path: str, obj, advice: str = "free space or make the folder writable, then run again") -> None:
    """Write through a temporary file and a rename, so readers never see half a file."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise write_failed("write", path, e, advice) from None


def read_position(checkpoint: str) -> dict:
    path = os.path.join(checkpoint, POSITION)
    if not os.path.isdir(checkpoint):
        raise InputError(f"checkpoint not found: {checkpoint}")
    if not os.path.isfile(path):
        raise InputError(f"{checkpoint} is not a complete checkpoint: it has no {POSITION} "
                         "(expected a step_<N>/ folder written by train.py)")
    try:
        with open(path, encoding="utf-8") as f:
            position = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path} is unreadable: {e}") from None
    if not isinstance(position, dict):
        raise InputError(f"{path} is not a JSON object; resume from another checkpoint")
    return position


def sealed(position: dict) -> dict:
    """position with a sha256 of its other fields, so that a changed byte in position.json is seen too."""
    fields = {key: value for key, value in position.items() if key != "sha256"}
    # Hashed as JSON reads it back: int keys become strings, tuples lists, and the checksum still matches.
    text = json.dumps(json.loads(json.dumps(fields)), sort_keys=True, ensure_ascii=False)
    return {**fields, "sha256": hashlib.sha256(text.encode()).hexdigest()}


def read_verified_position(checkpoint: str) -> dict:
    """read_position, refusing a position.json whose fields are not the ones saved (its own sha256 differs).
    One written before positions carried a sha256 has none to check (verify_files says so)."""
    position = read_position(checkpoint)
    if "sha256" in position and sealed(position)["sha256"] != position["sha256"]:
        raise InputError(f"cannot load checkpoint {checkpoint}: {POSITION} is not the file that was saved (its sha256 "
                         "differs); use another checkpoint")
    return position


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


def find_resume_checkpoint(resume: Optional[str], output_dir: str, overwrite: bool) -> Optional[str]:
    """The checkpoint to resume from, or None to start fresh; refuses to mix runs in one folder."""
    refuse_if_in_use(output_dir)
    return choose_checkpoint(resume, output_dir, overwrite)


def choose_checkpoint(resume: Optional[str], output_dir: str, overwrite: bool) -> Optional[str]:
    existing = complete_checkpoints(output_dir)
    if resume == "auto":  # one command that starts a run and continues it (a requeued job reruns its command)
        return existing[-1][1] if existing else None
    if resume == "latest":
        newer = without_position(output_dir, existing[-1][0] if existing else -1)
        if not existing:
            raise InputError(f"--resume latest: no complete checkpoint in {output_dir}"
                             + (f" ({', '.join(newer)} without {POSITION})" if newer else "")
                             + "; drop --resume to start a fresh run")
        if newer and int(os.environ.get("RANK", "0")) == 0 and newer[-1] not in _warned:
            _warned.add(newer[-1])
            print(f"warning: {os.path.join(output_dir, newer[-1], POSITION)} is missing (a save always writes it, so "
                  f"it was deleted or lost): {newer[-1]} is not a complete checkpoint, and --resume latest takes "
                  f"{existing[-1][1]}", file=sys.stderr)
        return existing[-1][1]
    if resume:
        return resume
    if existing and not overwrite:
        raise InputError(f"{output_dir} already holds checkpoints (newest {existing[-1][1]}); pass --resume latest "
                         "to continue that run, or --overwrite_output_dir to start over")
    return None


def without_position(output_dir: str, newer_than: int) -> list[str]:
    """The step_<N> folders above step `newer_than` that have no position.json, oldest first: a save never
    leaves one (it writes into .incomplete_step_<N>/ and renames), so its position.json was deleted or lost."""
    return [os.path.basename(path) for step, path in step_folders(output_dir)
            if step > newer_than and not os.path.isfile(os.path.join(path, POSITION))]


def continue_advice(output_dir: str, free_space: bool = True) -> str:
    """What to do after a failed write: continue from the newest complete checkpoint, or start again."""
    previous = complete_checkpoints(output_dir)
    then = (f"continue with --resume latest (the newest complete checkpoint, {previous[-1][1]}, is untouched)"
            if previous else "start again: no checkpoint was completed yet")
    if not free_space:
        return then
    return f"free space (or choose another --output_dir){', then' if previous else ' and'} {then}"


LAUNCH_KEYS = ("zero_stage", "mixed_precision")  # the IDENTITY keys the launch decides


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


def check_launch(checkpoint: str, position: dict, run: dict) -> Optional[str]:
    """Before any data is read: refuse a launch that cannot resume `checkpoint`, giving the one that can. Returns
    the line that says how a resume on another number of processes keeps the global batch, or None."""
    this = {"world_size": run["num_processes"], "zero_stage": run["zero_stage"],
            "mixed_precision": run["mixed_precision"]}
    differ = [f"{IDENTITY[key]} {position.get(key)} (this launch: {this[key]})" for key in LAUNCH_KEYS
              if key in position and position[key] != this[key]]
    made_on = position.get("world_size")
    if made_on != this["world_size"] and not differ:  # ZeRO's partitions go through a universal checkpoint
        if run.get("distributed_type") == "FSDP" or os.path.isdir(os.path.join(checkpoint, FSDP_SHARDED)):
            differ.append(f"FSDP on {processes(made_on)} (this launch: {this['world_size']}), whose sharded "
                          "states this textclf does not reshard")
    if differ:
        raise InputError(f"cannot resume from {checkpoint}: it was made by a launch with {', '.join(differ)}; "
                         f"resume it with {launch_for(position)} --resume {checkpoint}")
    if made_on == this["world_size"]:
        return None
    split = batch_split(checkpoint, position, this["world_size"])
    return (f"resuming {checkpoint}, made by {processes(made_on)} with micro-batch "
            f"{position['per_device_train_batch_size']} and gradient accumulation "
            f"{position.get('gradient_accumulation_steps')}, on {processes(this['world_size'])}: micro-batch "
            f"{split['per_device_train_batch_size']} and gradient accumulation {split['gradient_accumulation_steps']} "
            f"keep its global batch of {position['global_batch_size']}")


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


def sha256(path: str) -> str:
    digest = hashlib.sha256()  # hashlib.file_digest would do this, from Python 3.11 on
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2 ** 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_all(paths: list[str]) -> list:
    """sha256 of each file, or the OSError that reading it raised; in threads, as hashlib hashes without
    holding the GIL (docs/checkpoints.md: what it costs)."""
    def digest(path):
        try:
            return sha256(path)
        except OSError as e:
            return e

    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return list(pool.map(digest, paths))


def manifest(folder: str) -> dict:
    """Every file of a checkpoint folder but position.json: its size and sha256, read back once written."""
    sizes = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if relative != POSITION:
                sizes[relative] = os.path.getsize(path)
    names = sorted(sizes)
    digests = sha256_all([os.path.join(folder, name) for name in names])
    for digest in digests:
        if isinstance(digest, OSError):
            raise digest
    return {name: {"size": sizes[name], "sha256": digest} for name, digest in zip(names, digests)}


def complete(folder: str, position: dict,
             advice: str = "free space or make the folder writable, then run again") -> None:
    """Write position.json, last: the position, the list of the folder's files and its own sha256."""
    write_json(os.path.join(folder, POSITION), sealed({**position, "files": manifest(folder)}), advice)


def required_states(world_size: int, zero_stage: Optional[int]) -> list[tuple[str, str]]:
    """What exact resume needs besides the loop position: (file, as a pattern where its name varies).

    The sampler needs nothing more: its order follows from (seed, epoch), and the position says how
    many of the epoch's batches were used. Accelerate skips an RNG file it cannot read with a log line
    at info level; the others fail loudly when loaded, but are checked here all the same.
    """
    needed = [("scheduler.bin", r"scheduler\.bin")]
    needed += [(f"random_states_{rank}.pkl", rf"random_states_{rank}\.pkl") for rank in range(world_size)]
    if zero_stage is None:  # one process or DDP; FSDP's sharded optimizer is a folder
        needed.append(("optimizer.bin", r"optimizer\.bin|optimizer_0/.+"))
    else:  # DeepSpeed: one partition of the optimizer per rank, in the tag folder that `latest` names
        needed += [(f"<tag>/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                    rf"[^/]+/(bf16_)?zero_pp_rank_{rank}_mp_rank_\d+_optim_states\.pt") for rank in range(world_size)]
    return needed


def listed_files(position: dict) -> Optional[dict]:
    files = position.get("files")
    valid = isinstance(files, dict) and files and all(isinstance(v, dict) for v in files.values())
    return files if valid else None


def recorded_file_problems(checkpoint: str, position: dict) -> list[str]:
    """How the files differ from the list position.json recorded when the checkpoint was completed: each is
    read in full and hashed, whatever its size. One line per file."""
    files = listed_files(position)
    if files is None:
        return [f"its {POSITION} lists no files to check it against (written by an older textclf, or edited); "
                "use a checkpoint this version wrote"]
    # Before position.json had a sha256 of its own, files above 16 MiB were recorded by size alone.
    older = "sha256" not in position
    problems, to_hash = [], []
    for name, recorded in files.items():
        path = os.path.join(checkpoint, name)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except OSError as e:
            problems.append(f"{name} is unreadable ({e.strerror})")
            continue
        if size != recorded.get("size"):
            problems.append(f"{name} has {size} bytes, {recorded.get('size')} when it was saved")
        elif "sha256" in recorded or not older:
            to_hash.append(name)
    for name, digest in zip(to_hash, sha256_all([os.path.join(checkpoint, name) for name in to_hash])):
        if isinstance(digest, OSError):
            problems.append(f"{name} is unreadable ({digest.strerror})")
        elif digest != files[name].get("sha256"):
            problems.append(f"{name} is not the file that was saved (its sha256 differs)")
    unhashed = sorted(name for name in files if name not in to_hash and not any(p.startswith(name) for p in problems))
    if older and unhashed:
        print(f"warning: {checkpoint} was written by an older textclf, which recorded no sha256 for "
              f"{', '.join(unhashed)} or for its {POSITION}: those are checked by their size alone", file=sys.stderr)
    return problems


def verify_checkpoint(checkpoint: str, position: dict) -> None:
    """Every file the checkpoint recorded is the one saved, before anything of it is loaded (export, predict,
    report, the best model's reload): one line per file that is not."""
    problems = recorded_file_problems(checkpoint, position)
    if problems:
        raise InputError("\n".join(f"cannot load checkpoint {checkpoint}: {problem}; use another checkpoint"
                                   for problem in problems))


def verify_files(checkpoint: str, position: dict) -> None:
    """Every file exact resume needs is there and readable, and every file the checkpoint recorded when
    it was completed is the one saved (recorded_file_problems): one line per file that is not."""
    problems = recorded_file_problems(checkpoint, position)
    files = listed_files(position)
    if files is None:
        raise InputError(f"cannot resume from {checkpoint}: {problems[0]}")
    problems += [f"{name} is not among the files it recorded" for name, pattern in
                 required_states(position["world_size"], position["zero_stage"])
                 if not any(re.fullmatch(pattern, recorded) for recorded in files)]
    for rank in range(position["world_size"]):  # what Accelerate would skip without a word
        name = f"random_states_{rank}.pkl"
        if name in files and not any(problem.startswith(name) for problem in problems):
            try:
                from accelerate.utils import load

                states = load(os.path.join(checkpoint, name))  # as Accelerate reads it: weights_only
            except (pickle.UnpicklingError, EOFError, RuntimeError) as e:  # torch.load's words for "not a state"
                states = e
            rng_keys = {"random_state", "numpy_random_seed", "torch_manual_seed"}
            if not (isinstance(states, dict) and rng_keys <= states.keys()):
                problems.append(f"{name} does not load as rank {rank}'s RNG state")
    if problems:
        raise InputError("\n".join(f"cannot resume from {checkpoint}: {problem}; resume from another checkpoint "
                                   "(--resume <output_dir>/step_<N>)" for problem in problems))


def refuse_if_in_use(output_dir: str) -> None:
    """Stop early when another run holds output_dir (claim_output_dir is where a run takes it).

    A shared lock for a moment: it conflicts with the owner's exclusive one, not with the other ranks'
    probes of this same run.
    """
    path = os.path.join(output_dir, LOCK)
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise in_use(output_dir, f.read()) from None
        except OSError:
            return  # a file system without locks: claim_output_dir says so
        fcntl.flock(f, fcntl.LOCK_UN)


def in_use(output_dir: str, holder: str) -> InputError:
    return InputError(f"{output_dir} is in use by another run ({holder.strip() or 'a process starting up'}); "
                      "wait for it to end, or choose another --output_dir")


def claim_output_dir(accelerator: Accelerator, output_dir: str, resume: Optional[str], overwrite: bool,
                     resume_from: Optional[str]) -> None:
    """Make output_dir this run's until it ends, before anything is written to it (collective).

    The main process takes an OS lock (flock) on output_dir/.lock and keeps it for the run's life; the
    kernel releases it when the process ends, however it ends, so a killed run leaves nothing to
    clear by hand. Other ranks never take it (they would block their own run's main process). On
    shared storage the lock holds across machines where the file system supports flock (NFSv4, and
    Lustre mounted with -o flock). Under the lock the choice of checkpoint is made again (a run that
    ended meanwhile may have written one), --overwrite_output_dir moves the previous run aside, and
    what a killed run left is removed.
    """
    def claim():
        if overwrite and resume_from and os.path.abspath(resume_from).startswith(
                os.path.join(os.path.abspath(output_dir), "")):
            raise InputError(f"--overwrite_output_dir moves the run in {output_dir} aside, --resume {resume} "
                             "continues it: drop one of them")
        try:
            os.makedirs(output_dir, exist_ok=True)
        except OSError as e:
            raise write_failed("create", output_dir, e,
                               "choose another --output_dir, or make its parent writable") from None
        lock_file = take_lock(output_dir)
        if choose_checkpoint(resume, output_dir, overwrite) != resume_from:
            raise InputError(f"another run wrote a checkpoint into {output_dir} while this one was starting; "
                             "start again to choose among them")
        if overwrite and set(os.listdir(output_dir)) - {LOCK}:
            aside = f"{os.path.normpath(output_dir)}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
            try:
                os.rename(output_dir, aside)  # the lock moves with it, still held, until the new one is taken
            except OSError as e:
                raise InputError(f"--overwrite_output_dir: cannot move the previous run in {output_dir} aside to "
                                 f"{aside} ({e.strerror}); move or delete it yourself") from None
            os.makedirs(output_dir, exist_ok=True)  # another run may have made it meanwhile: the lock decides
            take_lock(output_dir)
            _held_locks.remove(lock_file)
            lock_file.close()
            print(f"--overwrite_output_dir: moved the previous run in {output_dir} aside to {aside} (delete it "
                  "when you no longer need it)")
        removed = remove_leftovers(output_dir)
        if removed:
            print(f"removed what an interrupted run left in {output_dir}: {', '.join(removed)}")

    checked_on_main_process(accelerator, claim)


def take_lock(output_dir: str):
    """Lock output_dir for this process and write who holds it into the lock file."""
    path = os.path.join(output_dir, LOCK)
    # A few tries: another run's refuse_if_in_use holds a shared lock for a moment.
    for attempt in range(20):
        try:
            lock_file = open(path, "a+", encoding="utf-8")
        except OSError as e:
            raise write_failed("lock", output_dir, e, "make it writable, or choose another --output_dir") from None
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            holder = lock_file.read()
            lock_file.close()
            if attempt == 19:
                raise in_use(output_dir, holder) from None
            time.sleep(0.1)
            continue
        except OSError as e:
            print(f"warning: cannot lock {output_dir} ({e.strerror}): its file system has no file locks, so "
                  "nothing stops a second run from writing into it", file=sys.stderr)
            break
        # Another run's --overwrite_output_dir may have moved the folder aside, lock file and all, while this
        # one waited: the lock it got is then no longer the folder's, whose .lock that run now holds.
        if is_current(lock_file, path):
            break
        lock_file.close()
    else:
        raise in_use(output_dir, "")
    lock_file.seek(0)
    lock_file.truncate()
    lock_file.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S %z')}, {' '.join(sys.argv)[:200]}\n")
    lock_file.flush()
    _held_locks.append(lock_file)
    return lock_file


def is_current(lock_file, path: str) -> bool:
    """Whether the open lock_file is the file at path (same device and inode)."""
    held = os.fstat(lock_file.fileno())
    try:
        current = os.stat(path)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino)


def remove_leftovers(output_dir: str) -> list[str]:
    """Delete what runs killed while saving or deleting a checkpoint left; main process only."""
    removed = sorted(name for name in os.listdir(output_dir) if name.startswith((INCOMPLETE, DELETING, UNIVERSAL)))
    for name in removed:
        try:
            shutil.rmtree(os.path.join(output_dir, name))
        except OSError as e:
            raise write_failed("remove the leftover", os.path.join(output_dir, name), e,
                               "delete it yourself, then run again") from None
    return removed


def delete_folder(path: str) -> None:
    """Delete a checkpoint folder through a rename first, so a kill mid-way never leaves a half-deleted
    folder under a checkpoint's name."""
    parent, name = os.path.split(os.path.normpath(path))
    doomed = os.path.join(parent, DELETING + name)
    try:
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(path, doomed)
        shutil.rmtree(doomed)
    except OSError as e:
        raise write_failed("delete the checkpoint", path, e, f"make the folder writable (what is left of it is "
                           f"{doomed}, which the next start removes), then continue with --resume latest") from None


UNIVERSAL = ".universal_"  # + step_<N>: a ZeRO checkpoint converted for another number of processes
DEEPSPEED_TAG = "pytorch_model"  # the folder accelerate's save_state has DeepSpeed write its states into


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


def universal_copy(accelerator: Accelerator, checkpoint: str, output_dir: str) -> str:
    """Collective: a folder that `accelerator.load_state` reads as `checkpoint`, with DeepSpeed's states
    converted to its universal checkpoint (deepspeed.checkpoint.ds_to_universal: one file per parameter and
    state, which any number of processes loads with `"checkpoint": {"load_universal": true}`). Accelerate's own
    files are linked, not copied. The main process converts; the folder is removed once loaded
    (load_state), or by the next start if the run is killed first."""
    folder = os.path.join(output_dir, UNIVERSAL + os.path.basename(os.path.normpath(checkpoint)))

    def convert():
        from argparse import Namespace

        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        refuse_round_robin(checkpoint)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        for name in os.listdir(checkpoint):
            if name != DEEPSPEED_TAG:
                os.symlink(os.path.abspath(os.path.join(checkpoint, name)), os.path.join(folder, name))
        try:  # DeepSpeed's script, called as its command line would call it
            ds_to_universal(Namespace(input_folder=os.path.join(checkpoint, DEEPSPEED_TAG),
                                      output_folder=os.path.join(folder, DEEPSPEED_TAG), num_extract_workers=1,
                                      num_merge_workers=1, keep_temp_folder=False, strict=True,
                                      inject_missing_state=True))
        except WRITE_ERRORS as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise write_failed("convert to a universal checkpoint", checkpoint, e,
                               f"free space in {output_dir}, then run again") from None

    checked_on_main_process(accelerator, convert)
    return folder


def refuse_round_robin(checkpoint: str) -> None:
    """DeepSpeed's conversion misplaces the parameters of a ZeRO-1/2 checkpoint saved with
    `round_robin_gradients` by more than one process (it reads them back in the order they were declared, not
    in the round-robin order of the partitions): measured, then refused rather than trained on. The zoo's
    DeepSpeed files leave it off."""
    import torch

    tag = os.path.join(checkpoint, DEEPSPEED_TAG)
    states = sorted(name for name in os.listdir(tag) if name.endswith("model_states.pt"))
    config = torch.load(os.path.join(tag, states[0]), map_location="cpu", weights_only=False).get("ds_config", {})
    zero = config.get("zero_optimization", {})
    if zero.get("round_robin_gradients") and zero.get("stage") in (1, 2):
        raise InputError(f"cannot resume {checkpoint} on another number of processes: it was saved with "
                         '"round_robin_gradients": true, whose partitions DeepSpeed\'s universal checkpoint '
                         "misreads; resume it on the number of processes that made it")


def load_state(accelerator: Accelerator, optimizer, checkpoint: str, output_dir: str, universal: bool) -> None:
    """Collective: `accelerator.load_state(checkpoint)`, through universal_copy where ZeRO's partitions change
    hands; a checkpoint that does not load is one line."""
    import torch

    load_from = universal_copy(accelerator, checkpoint, output_dir) if universal else checkpoint
    # DeepSpeed's universal load gives every parameter group the first group's settings ("generally the same",
    # stage3.py): the no-decay group would be decayed. The groups' own settings are put back after it.
    settings = [{key: value for key, value in group.items() if key not in ("params", "lr")}
                for group in optimizer.param_groups]
    try:
        accelerator.load_state(load_from)
    except pickle.UnpicklingError as e:  # refused by weights_only: a pickle that holds more than tensors
        raise InputError(f"cannot load checkpoint {checkpoint}: {str(e).splitlines()[0]}") from None
    # load_state also restores accelerate's micro-batch counter, which decides where gradients sync; it counts in
    # the saved accumulation, and a checkpoint always sits where they synced: zero, in any accumulation's units.
    accelerator.step = 0
    if universal:
        # It also gives every ZeRO-3 partition one shared `step` tensor, which fused AdamW then increments in place
        # once per partition at each step: each gets its own. (optimizer.optimizer is DeepSpeed's ZeRO optimizer,
        # its .optimizer the torch one; test_resume.py's ZeRO-3 resumes fail if either changes.)
        for state in optimizer.optimizer.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        for group, own in zip(optimizer.param_groups, settings):
            group.update(own)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(load_from, ignore_errors=True)


def save_checkpoint(accelerator: Accelerator, output_dir: str, position: dict, save_extra) -> str:
    """Collective: every rank calls it. Returns the checkpoint path.

    A failed write (a full disk, a quota) stops the run with one line that names the newest complete
    checkpoint, which it leaves as it was. The rank that fails stops without another collective:
    DeepSpeed's save may have left the others waiting in its own barrier, and the launcher stops them.
    """
    final = checkpoint_folder(output_dir, position["step"])
    tmp = os.path.join(output_dir, f"{INCOMPLETE}step_{position['step']}")
    advice = continue_advice(output_dir)
    if accelerator.is_main_process and os.path.exists(tmp):
        shutil.rmtree(tmp)  # left by a run killed while saving
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(tmp)
    except WRITE_ERRORS as e:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back now; the next start would
        if peer_ended(e):  # DeepSpeed's save is collective: a rank that died is not a full disk
            raise InputError(f"cannot save checkpoint {final}: {PEER_ENDED} during the save ({gist(e)}; its own "
                             f"message or the launcher's report says why); "
                             f"{continue_advice(output_dir, free_space=False)}") from None
        raise write_failed("save checkpoint", final, e, advice) from None
    accelerator.wait_for_everyone()  # every rank writes its own files (RNG states, ZeRO shards) into tmp
    if accelerator.is_main_process:
        try:
            save_extra(tmp)
            complete(tmp, position, advice)
            if os.path.exists(final):  # a re-run of a step: the new one replaces the old in one rename
                delete_folder(final)
            os.replace(tmp, final)
        except WRITE_ERRORS as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_failed("save checkpoint", final, e, advice) from None
        except InputError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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
        kept |= {path for _, path in found if os.path.abspath(path) == os.path.abspath(protect)}
    removed = [path for _, path in found if path not in kept]
    for path in removed:
        delete_folder(path)
    return removed
