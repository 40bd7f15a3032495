"""The output folder a run owns, one run at a time: the checkpoint a run in it continues (find_checkpoint), the lock
its main process holds for the run's life (flock, released by the kernel however the process ends), what
--overwrite_output_dir moves aside (never what the run reads), and what a killed run left, removed when the next run
claims the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Optional

from textclf import files
from textclf.config import TrainConfig
from textclf.errors import InputError, checked_on_main_process, write_failed

from .folders import LEFTOVERS, LOCK, choose_checkpoint, later_checkpoints, resolved_checkpoint
from .verify import read_position
from .write import own_secret

if TYPE_CHECKING:
    from accelerate import Accelerator


_held_locks = []  # the open lock files of this process: closing one would release the folder


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
    of one of its checkpoints, the checkpoints after it), and what a killed run left is removed. The secret its
    checkpoints are signed with is made here if this user has none yet: a run that could not sign stops before
    it trains.
    """
    resume = resolved_checkpoint(resume)  # as find_checkpoint resolved it
    inside = bool(resume_from) and holds(output_dir, resume_from)

    def claim():
        if overwrite and inside and resume in ("latest", "auto"):
            raise InputError(f"--overwrite_output_dir moves the run in {output_dir} aside, --resume {resume} "
                             "continues it: drop one of them")
        own_secret()
        refuse_a_file(output_dir)
        try:
            made = files.make_folders(output_dir)
        except OSError as e:
            raise write_failed("create", output_dir, e,
                               "choose another --output_dir, or make its parent writable") from None
        try:
            take_folder(output_dir, resume, overwrite, resume_from, inside)
        except BaseException:
            files.remove_empty(made)  # a failed claim leaves no empty folder of its own making behind
            raise

    checked_on_main_process(accelerator, claim)


def take_folder(output_dir: str, resume: Optional[str], overwrite: bool, resume_from: Optional[str],
                inside: bool) -> None:
    """claim_output_dir's work under the lock, in output_dir, which exists (main process). `inside`: resume_from is
    a checkpoint of output_dir."""
    lock_file = take_lock(output_dir)
    if choose_checkpoint(resume, output_dir, overwrite) != resume_from:
        raise InputError(f"another run wrote a checkpoint into {output_dir} while this one was starting; "
                         "start again to choose among them")
    if overwrite and inside:  # --resume <a checkpoint of it>: only the checkpoints after it go aside
        move_aside(output_dir, later_checkpoints(output_dir, resume_from))
    elif overwrite and set(os.listdir(output_dir)) - {LOCK}:
        move_run_aside(output_dir)  # the lock moves with it, still held, until the new one is taken
        take_lock(output_dir)
        _held_locks.remove(lock_file)
        lock_file.close()
    if any(name.startswith(LEFTOVERS) for name in os.listdir(output_dir)):
        removed = remove_leftovers(output_dir)
        print(f"removed what an interrupted run left in {output_dir}: {', '.join(removed)}")


def holds(folder: str, path: str) -> bool:
    """Whether `path` is `folder` or lies inside it, by its path as given or through the links on the way."""
    return any(os.path.commonpath([inner, outer]) == outer
               for inner, outer in ((os.path.abspath(path), os.path.abspath(folder)),
                                    (os.path.realpath(path), os.path.realpath(folder))))


def take_lock(output_dir: str):
    """Lock output_dir for this process and write who holds it into the lock file."""
    path = os.path.join(output_dir, LOCK)
    # A few tries: another run's refuse_if_in_use holds a shared lock for a moment.
    for attempt in range(20):
        try:  # never through a link planted in its place
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


def aside_folder(output_dir: str) -> str:
    return f"{os.path.normpath(output_dir)}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"


def move_run_aside(output_dir: str) -> None:
    """Rename output_dir aside and make it again, empty."""
    aside = aside_folder(output_dir)
    try:
        os.rename(output_dir, aside)
    except OSError as e:
        raise InputError(f"--overwrite_output_dir: cannot move the previous run in {output_dir} aside to "
                         f"{aside} ({e.strerror}); move or delete it yourself") from None
    os.makedirs(output_dir, exist_ok=True)  # another run may have made it meanwhile: the lock decides
    print(f"--overwrite_output_dir: moved the previous run in {output_dir} aside to {aside} (delete it "
          "when you no longer need it)")


def move_aside(output_dir: str, names: list[str]) -> None:
    """Move the folders `names` of output_dir aside."""
    if not names:
        return
    aside = aside_folder(output_dir)
    try:
        os.makedirs(aside, exist_ok=True)
        for name in names:
            os.rename(os.path.join(output_dir, name), os.path.join(aside, name))
    except OSError as e:
        raise InputError(f"--overwrite_output_dir: cannot move {', '.join(names)} of {output_dir} aside to {aside} "
                         f"({e.strerror}); move or delete them yourself") from None
    print(f"--overwrite_output_dir: moved {', '.join(names)} of {output_dir} aside to {aside} (delete it when you no "
          "longer need it)")


def remove_leftovers(output_dir: str) -> list[str]:
    """Delete what runs killed while saving or deleting a checkpoint left; main process only."""
    removed = sorted(name for name in os.listdir(output_dir) if name.startswith(LEFTOVERS))
    for name in removed:
        try:
            files.remove(os.path.join(output_dir, name))
        except OSError as e:
            raise write_failed("remove the leftover", os.path.join(output_dir, name), e,
                               "delete it yourself, then run again") from None
    return removed


def refuse_a_file(output_dir: str) -> None:
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise InputError(f"--output_dir {output_dir} is a file, not a folder; choose another --output_dir (or move "
                         "that file away)")


def refuse_unusable(output_dir: str) -> None:
    """Stop early where the run cannot take output_dir: a file is there, or another run holds it."""
    refuse_a_file(output_dir)
    refuse_if_in_use(output_dir)


def refuse_moving_what_it_reads(cfg: TrainConfig, output_dir: str, checkpoint: Optional[str]) -> None:
    """--overwrite_output_dir moves output_dir aside (with --resume of one of its checkpoints, the checkpoints after
    it): refused, before anything moves, where that holds a file or folder the run reads, which the run (or the
    next --resume) would then not find."""
    if checkpoint and holds(output_dir, checkpoint):
        moved = [os.path.join(output_dir, name) for name in later_checkpoints(output_dir, checkpoint)]
        what = f"{', '.join(map(os.path.basename, moved))} of {output_dir}"
    else:
        moved = [output_dir] if os.path.isdir(output_dir) and set(os.listdir(output_dir)) - {LOCK} else []
        what = f"the run in {output_dir}"
    for flag, path in read_by_the_run(cfg, checkpoint):
        if any(holds(folder, path) for folder in moved):
            raise InputError(f"--overwrite_output_dir would move {what} aside, and this run reads {flag} {path} "
                             f"from there; move it out of {output_dir} first, or choose another --output_dir")


def read_by_the_run(cfg: TrainConfig, checkpoint: Optional[str]) -> list[tuple[str, str]]:
    """(flag, path) of what the run reads from disk: --data, --eval_data, a local --model, the checkpoint it resumes.
    A resume reads those its checkpoint recorded where the command line gives none (config_of)."""
    given = {key: getattr(cfg, key) for key in ("data", "eval_data", "model")}
    if checkpoint:
        try:
            recorded = read_position(checkpoint).get("config") or {}
        except InputError:  # the resume refuses it, in its own words
            recorded = {}
        given = {key: recorded.get(key) if value == getattr(TrainConfig, key) and recorded.get(key) else value
                 for key, value in given.items()}
    reads = [(f"--{key}", value) for key, value in given.items()
             if isinstance(value, str) and value and (key != "model" or os.path.exists(value))]
    return reads + ([("--resume", checkpoint)] if checkpoint else [])
