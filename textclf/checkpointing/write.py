"""Checkpoints as a run writes them: accelerate's save_state writes into a temporary folder, which position.json
seals (the position, and the size and sha256 of every file, signed with this user's secret) and a rename makes
`step_<N>/`, so that a checkpoint is complete or absent. A write that fails is one line naming the newest complete
checkpoint, left as it was.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from typing import TYPE_CHECKING

from textclf import files
from textclf.errors import WRITE_ERRORS, InputError, write_failed
from textclf.files import sha256_all, write_json

from .folders import INCOMPLETE, POSITION, checkpoint_folder, complete_checkpoints
from .rotation import delete_folder
from .seal import own_secret, sealed

if TYPE_CHECKING:
    from accelerate import Accelerator


def continue_advice(output_dir: str, free_space: bool = True) -> str:
    """What to do after a failed write: continue from the newest complete checkpoint, or start again."""
    previous = complete_checkpoints(output_dir)
    then = (f"continue with --resume latest (the newest complete checkpoint, {previous[-1][1]}, is untouched)"
            if previous else "start again: no checkpoint was completed yet")
    if not free_space:
        return then
    return f"free space (or choose another --output_dir){', then' if previous else ' and'} {then}"


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
    """Write position.json, last: the position and the list of the folder's files, signed with this user's secret,
    and its own sha256."""
    write_json(os.path.join(folder, POSITION), sealed({**position, "files": manifest(folder)}, own_secret()), advice)


@contextmanager
def sealed_checkpoint(accelerator: Accelerator, output_dir: str, position: dict):
    """Collective: yields the temporary folder that `accelerator.save_state` (and whatever else the checkpoint holds)
    writes into; then seals it with position.json (`position` with the size and sha256 of every file) and renames it
    to step_<N>, in place of a checkpoint of the same step, so that a step_<N> folder is complete or absent.

    A failed write (a full disk, a quota) stops the run with one line that names the newest complete checkpoint,
    which it leaves as it was. The rank that fails stops without another collective: DeepSpeed's save may have left
    the others waiting in its own barrier, and the launcher stops them.
    """
    final = checkpoint_folder(output_dir, position["step"])
    tmp = os.path.join(output_dir, f"{INCOMPLETE}step_{position['step']}")
    advice = continue_advice(output_dir)
    if accelerator.is_main_process:
        new_checkpoint_folder(tmp, final, advice)
    accelerator.wait_for_everyone()
    try:
        yield tmp
    except WRITE_ERRORS as e:  # said before the space is given back: a full disk is told by its free space
        failure = write_failed("save checkpoint", final, e, advice, continue_advice(output_dir, free_space=False))
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back now; the next start would
        raise failure from None
    except InputError:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()  # every rank writes its own files (RNG states, ZeRO shards) into tmp
    if accelerator.is_main_process:
        try:
            complete(tmp, position, advice)
            if os.path.lexists(final):  # a re-run of a step: the new one replaces the old in one rename
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


def new_checkpoint_folder(tmp: str, final: str, advice: str) -> None:
    """The folder a checkpoint is saved into, made afresh (what a run killed while saving left there is removed,
    and a link planted in its place is removed, never written through)."""
    try:
        files.new_folder(tmp)
    except OSError as e:
        raise write_failed("save checkpoint", final, e, advice) from None
