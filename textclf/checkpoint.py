"""Checkpoints as a run writes them: atomic `step_<N>/` folders that describe themselves, and the output folder that
one run at a time owns (what a resume checks and loads is in textclf/resume.py, deletion in textclf/rotation.py).

A checkpoint is what `accelerator.save_state` writes plus `position.json`: the loop position, what the run was made
with (start.record), its evaluation, config and loss windows, and the size and sha256 of every file, sealed by a
sha256 of its own fields. It is written last, into a temporary folder then renamed, so a `step_<N>/` folder either
is complete or does not exist; whatever loads a checkpoint first reads every file against that list. Folders are
deleted through a rename too, and what a killed run leaves (`.incomplete_*`, `.deleting_*`) is removed when the
next run claims the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # accelerate is imported where it is used: a resume is checked before torch loads (train.py)
    from accelerate import Accelerator

from . import files
from .errors import WRITE_ERRORS, InputError, checked_on_main_process, write_failed

POSITION = "position.json"
# Where accelerate's save_state puts FSDP's sharded model state (f"{FSDP_MODEL_NAME}_0"; test_users checks it):
# a torch.distributed.checkpoint folder, whose metadata file torch reads with full pickle.
FSDP_SHARDED = "pytorch_model_fsdp_0"
STEP_DIR = re.compile(r"^step_(\d+)$")
INCOMPLETE = ".incomplete_"  # + step_<N>: a checkpoint being written
DELETING = ".deleting_"  # + step_<N>: a checkpoint being deleted
UNIVERSAL = ".universal_"  # + step_<N>: a ZeRO checkpoint converted for another number of processes
# What runs killed while saving, deleting or converting a checkpoint leave (textclf/leftovers.py removes it).
LEFTOVERS = (INCOMPLETE, DELETING, UNIVERSAL)
LOCK = ".lock"  # held (flock) by the main process of the run that owns the folder
_held_locks = []  # the open lock files of this process: closing one would release the folder


def write_json(path: str, obj, advice: str = "free space or make the folder writable, then run again") -> None:
    """Write through a temporary file and a rename, so readers never see half a file (and never through a
    symbolic link: textclf/files.py)."""
    with files.replacing(path, encoding="utf-8", advice=advice) as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def sealed(position: dict) -> dict:
    """position with a sha256 of its other fields, so that a changed byte in position.json is seen too."""
    fields = {key: value for key, value in position.items() if key != "sha256"}
    # Hashed as JSON reads it back: int keys become strings, tuples lists, and the checksum still matches.
    text = json.dumps(json.loads(json.dumps(fields)), sort_keys=True, ensure_ascii=False)
    return {**fields, "sha256": hashlib.sha256(text.encode()).hexdigest()}


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
    path = choose_checkpoint(resume, output_dir, overwrite)
    if resume == "latest":
        from .resume import warn_of_lost_positions

        warn_of_lost_positions(output_dir, path)
    return path


def choose_checkpoint(resume: Optional[str], output_dir: str, overwrite: bool) -> Optional[str]:
    """find_resume_checkpoint's choice, made again under the lock (claim_output_dir)."""
    existing = complete_checkpoints(output_dir)
    if resume not in (None, "auto"):
        from .resume import named_checkpoint

        return named_checkpoint(resume, output_dir, overwrite, existing)
    if resume == "auto":  # one command that starts a run and continues it (a requeued job reruns its command)
        return existing[-1][1] if existing else None
    if existing and not overwrite:
        raise InputError(f"{output_dir} already holds checkpoints (newest {existing[-1][1]}); pass --resume latest "
                         "to continue that run, or --overwrite_output_dir to start over")
    return None


def continue_advice(output_dir: str, free_space: bool = True) -> str:
    """What to do after a failed write: continue from the newest complete checkpoint, or start again."""
    previous = complete_checkpoints(output_dir)
    then = (f"continue with --resume latest (the newest complete checkpoint, {previous[-1][1]}, is untouched)"
            if previous else "start again: no checkpoint was completed yet")
    if not free_space:
        return then
    return f"free space (or choose another --output_dir){', then' if previous else ' and'} {then}"


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


def refuse_if_in_use(output_dir: str) -> None:
    """Stop early when another run holds output_dir (claim_output_dir is where a run takes it).

    A shared lock for a moment: it conflicts with the owner's exclusive one, not with the other ranks'
    probes of this same run.
    """
    path = os.path.join(output_dir, LOCK)
    try:
        f = files.open_existing(path, "r", encoding="utf-8")
    except OSError:  # none yet; or not a file, or a link, which claim_output_dir refuses
        return
    with f:
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
    ended meanwhile may have written one), --overwrite_output_dir moves the previous run aside (with --resume
    of one of its checkpoints, the checkpoints after it), and what a killed run left is removed.
    """
    inside = bool(resume_from) and os.path.abspath(resume_from).startswith(
        os.path.join(os.path.abspath(output_dir), ""))

    def claim():
        if overwrite and inside and resume in ("latest", "auto"):
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
        if overwrite and inside:  # --resume <a checkpoint of it>: only the checkpoints after it go aside
            from .overwrite import move_aside
            from .resume import later_checkpoints

            move_aside(output_dir, later_checkpoints(output_dir, resume_from))
        elif overwrite and set(os.listdir(output_dir)) - {LOCK}:
            from .overwrite import move_run_aside

            move_run_aside(output_dir)  # the lock moves with it, still held, until the new one is taken
            take_lock(output_dir)
            _held_locks.remove(lock_file)
            lock_file.close()
        if any(name.startswith(LEFTOVERS) for name in os.listdir(output_dir)):
            from .leftovers import remove_leftovers

            removed = remove_leftovers(output_dir)
            print(f"removed what an interrupted run left in {output_dir}: {', '.join(removed)}")

    checked_on_main_process(accelerator, claim)


def take_lock(output_dir: str):
    """Lock output_dir for this process and write who holds it into the lock file."""
    path = os.path.join(output_dir, LOCK)
    # A few tries: another run's refuse_if_in_use holds a shared lock for a moment.
    for attempt in range(20):
        try:  # never through a link planted in its place (textclf/files.py)
            lock_file = files.open_lock(path)
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
    try:
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S %z')}, {' '.join(sys.argv)[:200]}\n")
        lock_file.flush()
    except OSError as e:  # a full disk: no lock file without its holder is left behind (unlinked while held)
        failure = write_failed("lock", output_dir, e, "free space, or choose another --output_dir")
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            lock_file.close()  # a buffered write that cannot be flushed fails again here
        raise failure from None
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


def save_checkpoint(accelerator: Accelerator, output_dir: str, position: dict, save_extra) -> str:
    """Collective: every rank calls it. Returns the checkpoint path.

    A failed write (a full disk, a quota) stops the run with one line that names the newest complete
    checkpoint, which it leaves as it was. The rank that fails stops without another collective:
    DeepSpeed's save may have left the others waiting in its own barrier, and the launcher stops them.
    """
    final = checkpoint_folder(output_dir, position["step"])
    tmp = os.path.join(output_dir, f"{INCOMPLETE}step_{position['step']}")
    advice = continue_advice(output_dir)
    if accelerator.is_main_process:
        new_checkpoint_folder(tmp, final, advice)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(tmp)
    except WRITE_ERRORS as e:  # said before the space is given back: a full disk is told by its free space
        failure = write_failed("save checkpoint", final, e, advice, continue_advice(output_dir, free_space=False))
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back now; the next start would
        raise failure from None
    accelerator.wait_for_everyone()  # every rank writes its own files (RNG states, ZeRO shards) into tmp
    if accelerator.is_main_process:
        try:
            save_extra(tmp)
            complete(tmp, position, advice)
            if os.path.lexists(final):  # a re-run of a step: the new one replaces the old in one rename
                from .rotation import delete_folder

                delete_folder(final)
            os.replace(tmp, final)
        except WRITE_ERRORS as e:
            failure = write_failed("save checkpoint", final, e, advice)
            shutil.rmtree(tmp, ignore_errors=True)
            raise failure from None
        except InputError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    accelerator.wait_for_everyone()
    return final


def new_checkpoint_folder(tmp: str, final: str, advice: str) -> None:
    """The folder a checkpoint is saved into, made afresh (what a run killed while saving left there is removed,
    and a link planted in its place is removed, never written through: textclf/files.py)."""
    try:
        files.new_folder(tmp)
    except OSError as e:
        raise write_failed("save checkpoint", final, e, advice) from None
