"""A checkpoint verified before anything of it is loaded: its position.json read and checked against its own sha256,
its signature checked against this user's secret (who wrote it), then every file it recorded when it was completed
(size and sha256) read in full and compared, and what an exact resume needs found there. A resume, the best model's
reload, export, predict and report all load through it.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
from contextlib import contextmanager
from stat import S_ISREG
from typing import TYPE_CHECKING, Iterable, Optional

from textclf.errors import InputError, checked_on_main_process
from textclf.files import sha256_all

from .folders import POSITION, find_best_checkpoint
from .pickles import refuse_pickle_unless_allowed, weights_only_loads
from .write import (
    SIGNATURE,
    SIGNED_BY,
    SIGNED_FORMAT,
    canonical,
    own_sha256,
    read_secret,
    secret_id,
    secret_path,
    signature_matches,
)

if TYPE_CHECKING:  # accelerate is imported after the pre-launch checks
    from accelerate import Accelerator

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
    """read_position, refusing a position.json whose fields are not the ones saved (its own sha256 differs, or was
    deleted). One an older textclf wrote, before positions carried a sha256, has none to check (verify_files says
    so)."""
    position = read_position(checkpoint)
    unsigned = [key for key in SIGNED_FORMAT if key in position and SIGNATURE not in position]
    if unsigned:
        raise InputError(f"cannot load checkpoint {checkpoint}: its {POSITION} records {unsigned[0]}, as only this "
                         "textclf writes, yet no signature, which this textclf always writes with it: its signature "
                         "was removed, and none of its fields can be trusted; use another checkpoint")
    if "sha256" not in position:
        why = why_not_older(position)
        if why:
            raise InputError(f"cannot load checkpoint {checkpoint}: its {POSITION} has no sha256 of its own, yet no "
                             f"older textclf wrote it ({why}): its sha256 was deleted, and none of its fields can be "
                             "trusted; use another checkpoint")
    elif own_sha256(position) != position["sha256"]:
        raise InputError(f"cannot load checkpoint {checkpoint}: {POSITION} is not the file that was saved (its sha256 "
                         "differs); use another checkpoint")
    return position


def authorship(checkpoint: str, position: dict) -> Optional[str]:
    """None where this user's secret proves that a run of theirs wrote the checkpoint as it is (its signature
    verifies); else why nothing proves who wrote it: a checkpoint from elsewhere, whose pickles need the user's
    say-so. A signature made with this user's secret that does not verify is an edit: refused."""
    if SIGNATURE not in position:
        return "it is not signed, as an older textclf left its checkpoints"
    if not (isinstance(position.get(SIGNED_BY), str) and re.fullmatch(r"[0-9a-f]{16}", position[SIGNED_BY])):
        raise InputError(f"cannot load checkpoint {checkpoint}: its {POSITION} has a signature but no id of the secret "
                         "that made it, which this textclf always writes with one: it was edited; use another "
                         "checkpoint")
    secret = read_secret()
    if secret is None:
        return f"this machine has no secret to check its signature with ({secret_path()})"
    if position.get(SIGNED_BY) != secret_id(secret):
        return f"it was signed with another secret than this user's ({secret_path()}): another user or machine wrote it"
    fields = {key: value for key, value in position.items() if key not in ("sha256", SIGNATURE)}
    if not signature_matches(canonical(fields), secret, position[SIGNATURE]):
        raise InputError(f"cannot load checkpoint {checkpoint}: its {POSITION} is not what this user's run signed "
                         "(its signature does not verify): it was edited; use another checkpoint")
    return None


# An older textclf, which wrote no sha256 of position.json, recorded the sha256 of each file up to this size and the
# size alone of larger ones.
OLDER_HASHED_UP_TO = 16 * 2 ** 20


def why_not_older(position: dict) -> Optional[str]:
    """What, in a position.json without a sha256 of its own, no older textclf wrote; None if an older one could have.

    The missing sha256 cannot tell an older position from an edited one, as deleting it is part of the edit; nor
    could a mark of the format, deleted as easily. What tells them apart is what an older textclf recorded, which
    the current one does not: a sha256 for each file up to 16 MiB and none for a larger one (the current one hashes
    every file), and no global_batch_size (recorded only since positions are sealed). An edit that deletes the
    sha256 alone is refused; one that also deletes global_batch_size leaves a position that no resume accepts (the
    global batch is how a resume splits its batches), and one that deletes the sha256 of the files above 16 MiB
    leaves them checked by size, and said so in a warning, as an older checkpoint's are.
    """
    if "global_batch_size" in position:
        return "it records global_batch_size"
    for name, recorded in (listed_files(position) or {}).items():
        size = recorded.get("size")
        hashed_by_older = isinstance(size, int) and size <= OLDER_HASHED_UP_TO
        if "sha256" in recorded and not hashed_by_older:
            return f"it records a sha256 for {name}, of {size} bytes, above {OLDER_HASHED_UP_TO // 2 ** 20} MiB"
        if "sha256" not in recorded and hashed_by_older:
            return f"it records no sha256 for {name}, of {size} bytes, {OLDER_HASHED_UP_TO // 2 ** 20} MiB or less"
    return None


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


def recorded_file_problems(checkpoint: str, position: dict, names: Optional[Iterable[str]] = None) -> list[str]:
    """How the files differ from the list position.json recorded when the checkpoint was completed: each is
    read in full and hashed, whatever its size. One line per file. `names`: those of the recorded files alone."""
    files = listed_files(position)
    if files is None:
        return [f"its {POSITION} lists no files to check it against (written by an older textclf, or edited); "
                "use a checkpoint this version wrote"]
    if names is not None:
        files = {name: files[name] for name in names}
    # Before position.json had a sha256 of its own, files above 16 MiB were recorded by size alone.
    older = "sha256" not in position and why_not_older(position) is None
    problems, to_hash = [], []
    for name, recorded in files.items():
        size, problem = recorded_file_size(checkpoint, name)
        if problem:
            problems.append(problem)
        elif size != recorded.get("size"):
            problems.append(f"{name} has {size} bytes, {recorded.get('size')} when it was saved")
        elif "sha256" in recorded or not older:
            to_hash.append(name)
    for name, digest in zip(to_hash, sha256_all([os.path.join(checkpoint, name) for name in to_hash])):
        if isinstance(digest, OSError):
            problems.append(f"{name} is unreadable ({digest.strerror})")
        elif digest != files[name].get("sha256"):
            problems.append(f"{name} is not the file that was saved (its sha256 differs)")
    unhashed = sorted(name for name in files if name not in to_hash and not any(p.startswith(name) for p in problems))
    if older:
        warn_older(checkpoint, unhashed)
    return problems


def recorded_file_size(checkpoint: str, name: str) -> tuple[Optional[int], Optional[str]]:
    """(the size of the file `name` records, None) where it is a regular file inside `checkpoint`; else (None, the
    line that says why not)."""
    if os.path.isabs(name) or name != os.path.normpath(name) or name == ".." or name.startswith("../"):
        return None, f"{name} is not a path inside the checkpoint, as a recorded file's always is"
    path = os.path.join(checkpoint, name)
    if os.path.realpath(os.path.dirname(path)) != os.path.join(os.path.realpath(checkpoint),
                                                                os.path.dirname(name)).rstrip(os.sep):
        return None, f"{name} is reached through a link, not a folder of the checkpoint as a run saves it"
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None, f"{name} is missing"
    except OSError as e:
        return None, f"{name} is unreadable ({e.strerror})"
    if not S_ISREG(status.st_mode):  # a link, a device: not what a run writes, whatever it leads to
        return None, f"{name} is not a regular file, as every file a run saves is"
    return status.st_size, None


def warn_older(checkpoint: str, unhashed: list[str]) -> None:
    """What an older textclf's checkpoint leaves unchecked: its position.json, and the files it recorded by size."""
    if unhashed:
        print(f"warning: {checkpoint} was written by an older textclf, which recorded no sha256 for "
              f"{', '.join(unhashed)} or for its {POSITION}: those are checked by their size alone", file=sys.stderr)
    else:
        print(f"warning: {checkpoint} was written by an older textclf, which recorded no sha256 for its {POSITION}: "
              "its fields are not checked", file=sys.stderr)


def verified_folder(checkpoint: str, folder: str) -> str:
    """The path of `checkpoint`'s sub-folder `folder` (the tokenizer train.py saves in it), for a resume to load
    before the rest of the checkpoint is verified: once position.json is the one saved and every file in the folder
    is one it recorded, as saved. One line per file that is not."""
    position = read_verified_position(checkpoint)
    files = listed_files(position)
    if files is None:
        raise InputError(f"cannot resume from {checkpoint}: {recorded_file_problems(checkpoint, position)[0]}")
    recorded = sorted(name for name in files if name.startswith(f"{folder}/"))
    if not recorded:
        raise InputError(f"cannot resume from {checkpoint}: its {POSITION} records no {folder}/ folder, which a "
                         "resume loads from it; resume from another checkpoint (--resume <output_dir>/step_<N>)")
    problems = recorded_file_problems(checkpoint, position, recorded)
    problems += [f"{name} is not among the files it recorded (loading {folder}/ would read it all the same)"
                 for name in unrecorded_files(checkpoint, position, folder)]
    if problems:
        raise InputError("\n".join(f"cannot resume from {checkpoint}: {problem}; resume from another checkpoint "
                                   "(--resume <output_dir>/step_<N>)" for problem in problems))
    return os.path.join(checkpoint, folder)


def verify_checkpoint(checkpoint: str, position: dict) -> None:
    """Every file the checkpoint recorded is the one saved, and it holds no other, before anything of it is loaded
    (export, predict, report, the best model's reload, which find the weights and the tokenizer's files by their
    names): one line per file that is not."""
    problems = recorded_file_problems(checkpoint, position)
    if listed_files(position) is not None:  # else the one problem is that it lists none
        problems += [f"{name} is not among the files it recorded" for name in unrecorded_files(checkpoint, position)]
    if problems:
        raise InputError("\n".join(f"cannot load checkpoint {checkpoint}: {problem}; use another checkpoint"
                                   for problem in problems))


def unrecorded_files(checkpoint: str, position: dict, folder: str = "") -> list[str]:
    """The files under `checkpoint`'s sub-folder `folder` (all of it by default) that its position.json does not
    record, position.json itself aside."""
    recorded = set(listed_files(position) or {}) | {POSITION}
    present = {os.path.relpath(os.path.join(root, name), checkpoint)
               for root, _, names in os.walk(os.path.join(checkpoint, folder)) for name in names}
    return sorted(present - recorded)


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


@contextmanager
def verified_best_checkpoint(accelerator: Accelerator, best: dict, output_dir: str, allow_pickle: bool):
    """Collective: yields the best checkpoint's folder (--load_best_model_at_end) for `accelerator.load_state`, once
    its position.json and every file are checked against their records and its signature judged, and with its
    pickles read as any checkpoint's are (weights_only_loads)."""
    checkpoint = find_best_checkpoint(best, output_dir)

    def check():
        position = read_verified_position(checkpoint)
        refuse_pickle_unless_allowed(checkpoint, authorship(checkpoint, position), allow_pickle)
        verify_checkpoint(checkpoint, position)

    checked_on_main_process(accelerator, check)
    with weights_only_loads(checkpoint, deepspeed=read_position(checkpoint).get("zero_stage") is not None,
                            allow_pickle=allow_pickle):
        yield checkpoint
