"""Checkpoints as a run writes them: accelerate's save_state writes into a temporary folder, which position.json
seals and a rename makes `step_<N>/`, so that a checkpoint is complete or absent. A write that fails is one line
naming the newest complete checkpoint, left as it was.

The seal: position.json (the position, and the size and sha256 of every file) signed with this user's secret, then
given a sha256 of its own. The secret is random bytes in a file outside any output folder, made at first use with
mode 0600 (`~/.config/textclf/checkpoint_secret`, or the file TEXTCLF_SECRET_FILE names); position.json carries an
HMAC-SHA256 of its fields under it, and the secret's id. A signature that verifies proves that a run of this user's
wrote the checkpoint, every field and every file's sha256 as they are: anyone can recompute a sha256, only the holder
of the secret can sign.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import shutil
from contextlib import contextmanager
from stat import S_IMODE, S_ISREG
from typing import TYPE_CHECKING, Optional

from textclf import files
from textclf.errors import WRITE_ERRORS, InputError, write_failed
from textclf.files import sha256_all, write_json

from .folders import INCOMPLETE, POSITION, checkpoint_folder, complete_checkpoints, delete_folder

if TYPE_CHECKING:
    from accelerate import Accelerator


SIGNATURE, SIGNED_BY = "signature", "signed_by"  # the HMAC of position.json's other fields, and the secret's id

STARTED_IN = "started_in"  # the folder the run started in, where the config's relative paths start from

# What this textclf writes in every position.json and no older one did: a position with any of them is signed.
SIGNED_FORMAT = (SIGNED_BY, STARTED_IN)


def canonical(fields: dict) -> bytes:
    """The text a position's sha256 and signature are computed over: its fields as JSON reads them back (int keys
    become strings, tuples lists), so that both still match once the file is read."""
    # surrogatepass: a lone surrogate (a path's undecodable byte, or an edit) is text JSON carries, not an error.
    return json.dumps(json.loads(json.dumps(fields)), sort_keys=True, ensure_ascii=False).encode("utf-8",
                                                                                                 "surrogatepass")


def sealed(position: dict, secret: Optional[bytes] = None) -> dict:
    """position signed with `secret` (its id and an HMAC of its other fields), then given a sha256 of every other
    field, so that a changed byte in position.json is seen with or without the secret."""
    fields = {key: value for key, value in position.items() if key not in ("sha256", SIGNATURE)}
    if secret is not None:
        fields[SIGNED_BY] = secret_id(secret)
        fields[SIGNATURE] = signature(canonical(fields), secret)
    return {**fields, "sha256": own_sha256(fields)}


def own_sha256(position: dict) -> str:
    """The sha256 of a position's fields but its own."""
    return hashlib.sha256(canonical({key: value for key, value in position.items() if key != "sha256"})).hexdigest()


SECRET_FILE = "TEXTCLF_SECRET_FILE"  # the environment variable that names the secret's file

SECRET_BYTES = 32  # HMAC-SHA256's block of security: as many random bytes as its output


def secret_path() -> str:
    """Where the secret is: the file TEXTCLF_SECRET_FILE names, else under the user's config folder."""
    named = os.environ.get(SECRET_FILE)
    if named:
        return os.path.abspath(os.path.expanduser(named))
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(config, "textclf", "checkpoint_secret")


class SecretNotPrivate(InputError):
    """The secret's file is there, and not this user's alone."""


def read_secret() -> Optional[bytes]:
    """This user's secret; None where there is none yet. One that cannot be trusted to be theirs alone (a link, not a
    regular file, another user's, readable by others), or cannot be used, is one line."""
    path = secret_path()
    try:
        # O_NOFOLLOW: a link planted at the path (dangling or not) is refused, never followed or replaced;
        # O_NONBLOCK: a FIFO planted there is refused below, not waited on.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        why = "it is a symbolic link" if os.path.islink(path) else e.strerror
        raise InputError(f"cannot read {path}, the secret that signs this user's checkpoints: {why}; make it a "
                         f"file of this user's, or name another file with {SECRET_FILE}") from None
    try:
        problem = secret_file_problem(os.fstat(fd))
        if problem:
            raise SecretNotPrivate(f"{path}, the secret that signs this user's checkpoints, {problem}: anyone who can "
                             "write or read it could sign checkpoints as this user; delete it (a run makes a new "
                             "one; checkpoints signed with the old one then count as written elsewhere), or name "
                             f"another file with {SECRET_FILE}")
        with open(fd, "rb", closefd=False) as f:
            secret = f.read()
    finally:
        os.close(fd)
    if len(secret) < SECRET_BYTES:
        raise InputError(f"{path}, the secret that signs this user's checkpoints, holds {len(secret)} bytes, fewer "
                         f"than {SECRET_BYTES}: delete it (a run makes a new one; checkpoints signed with the old one "
                         "then count as written elsewhere), or name another file with " + SECRET_FILE)
    return secret


def secret_file_problem(stat: os.stat_result) -> Optional[str]:
    """What makes a secret's file not this user's alone, as ssh judges a private key's; None where it is."""
    if not S_ISREG(stat.st_mode):
        return "is not a regular file"
    if stat.st_uid not in (os.getuid(), 0):  # root's: as ssh, for root can read it anyway
        return f"belongs to another user (uid {stat.st_uid})"
    if stat.st_mode & 0o077:
        return f"has mode {S_IMODE(stat.st_mode):o}, open to others (chmod 600 it if it is yours)"
    return None


def own_secret() -> bytes:
    """This user's secret, made at first use: random bytes written to a private file under a temporary name and
    linked into place, so two runs starting at once end up with the one that was linked first."""
    secret = read_secret()
    if secret is not None:
        return secret
    path = secret_path()
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with open(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another run made it first: that one is the secret
            os.link(tmp, path)
    except OSError as e:
        raise InputError(f"cannot make {path}, the secret that signs this run's checkpoints: {e.strerror}; set "
                         f"{SECRET_FILE} to a file path this user can write (docs/checkpoints.md)") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    try:
        secret = read_secret()
    except SecretNotPrivate:  # made 0600 and this user's, read back otherwise
        if os.path.isfile(path) and not os.path.islink(path):
            raise InputError(f"{path}, the secret made to sign this run's checkpoints, does not stay private on its "
                             "file system (a network or Windows mount that shows every file with one owner and "
                             f"mode); set {SECRET_FILE} to a file on a local disk (docs/checkpoints.md)") from None
        raise
    if secret is None:  # gone between its link and this read: no checkpoint is ever written unsigned
        raise InputError(f"{path}, the secret that signs this run's checkpoints, vanished as it was made; start the "
                         f"run again, or name another file with {SECRET_FILE}")
    return secret


def secret_id(secret: bytes) -> str:
    """What a position records of the secret that signed it: tells this user's secret from another's, and gives
    nothing of it away."""
    return hmac.new(secret, b"textclf checkpoint secret id", hashlib.sha256).hexdigest()[:16]


def signature(text: bytes, secret: bytes) -> str:
    return hmac.new(secret, text, hashlib.sha256).hexdigest()


def signature_matches(text: bytes, secret: bytes, signed: object) -> bool:
    # compare_digest takes ASCII text alone: anything else is not a signature this code made.
    return isinstance(signed, str) and signed.isascii() and hmac.compare_digest(signature(text, secret), signed)


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
