"""A checkpoint verified before anything of it is loaded: its position.json read and checked against its own sha256,
then every file it recorded when it was completed (size and sha256) read in full and compared, and what an exact
resume needs found there. A resume, the best model's reload, export, predict and report all load through it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import sys
from typing import TYPE_CHECKING, Optional

from textclf.errors import InputError, checked_on_main_process
from textclf.files import sha256_all

from .folders import POSITION, find_best_checkpoint

if TYPE_CHECKING:  # accelerate is imported after the pre-launch checks
    from accelerate import Accelerator


def sealed(position: dict) -> dict:
    """position with a sha256 of its other fields, so that a changed byte in position.json is seen too."""
    fields = {key: value for key, value in position.items() if key != "sha256"}
    # Hashed as JSON reads it back: int keys become strings, tuples lists, and the checksum still matches.
    text = json.dumps(json.loads(json.dumps(fields)), sort_keys=True, ensure_ascii=False)
    return {**fields, "sha256": hashlib.sha256(text.encode()).hexdigest()}


def read_position(checkpoint: str) -> dict:
    """A checkpoint's position.json, refused in one line where it is missing or unreadable."""
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


def read_verified_position(checkpoint: str) -> dict:
    """read_position, refusing a position.json whose fields are not the ones saved (its own sha256 differs).
    One written before positions carried a sha256 has none to check (verify_files says so)."""
    position = read_position(checkpoint)
    if "sha256" in position and sealed(position)["sha256"] != position["sha256"]:
        raise InputError(f"cannot load checkpoint {checkpoint}: {POSITION} is not the file that was saved (its sha256 "
                         "differs); use another checkpoint")
    return position


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
    # accelerate's load_state also reads every custom_checkpoint_<i>.pkl it finds, as the state of an object
    # registered for checkpointing (train.py registers none), and fails on one it has no object for.
    problems += [f"{name} is not among the files it recorded (accelerate would load it as the state of an object "
                 "this run does not register); remove it" for name in sorted(os.listdir(checkpoint))
                 if re.fullmatch(r"custom_checkpoint_\d+\.pkl", name) and name not in files]
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


def verified_best_checkpoint(accelerator: Accelerator, best: dict, output_dir: str) -> str:
    """Collective: the best checkpoint's folder (--load_best_model_at_end), every file checked against its record
    before `accelerator.load_state` reads it."""
    checkpoint = find_best_checkpoint(best, output_dir)
    checked_on_main_process(accelerator, lambda: verify_checkpoint(checkpoint, read_verified_position(checkpoint)))
    return checkpoint
