"""Writing into folders that others may share (a group's scratch space): a run never writes through a symbolic link
put in place of one of its files or folders. A file is written under a temporary name created afresh (O_EXCL,
O_NOFOLLOW) and renamed over its final name (os.replace replaces a link, never follows it); a file opened in place
(the lock, log.jsonl) refuses a link (O_NOFOLLOW); a link in place of a folder is removed, never walked into.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

from textclf.errors import write_failed

# Open flags for a file this process writes, never through a link; O_CLOEXEC: no child process inherits it.
NO_LINK = os.O_NOFOLLOW | os.O_CLOEXEC


def remove(path: str) -> None:
    """Remove what is at `path` (a link itself, not what it points to); nothing there is no error."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def open_new(path: str, mode: str = "w", **kwargs):
    """A new file at `path`, open for writing: what was there is removed first, and the file created exclusively,
    so a link planted there meanwhile fails the open."""
    remove(path)
    return open(path, mode, opener=opener(os.O_WRONLY | os.O_CREAT | os.O_EXCL), **kwargs)


@contextlib.contextmanager
def replacing(path: str, mode: str = "w", *, advice: str, what: str = "write", suffix: str = ".tmp", **kwargs):
    """A new file (open_new) that replaces `path` in one rename when the block ends: readers never see half a
    file. A failed write is one line (write_failed), and the temporary file is removed."""
    tmp = f"{path}{suffix}"
    try:
        with open_new(tmp, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        failure = write_failed(what, path, e, advice)
        with contextlib.suppress(OSError):
            remove(tmp)
        raise failure from None


def open_append(path: str, mode: str = "a", **kwargs):
    """`path` open for appending (created if absent); a link at `path` fails the open (ELOOP)."""
    return open(path, mode, opener=opener(os.O_WRONLY | os.O_APPEND | os.O_CREAT), **kwargs)


def open_existing(path: str, mode: str = "rb", **kwargs):
    """`path` open for reading; a link at `path` fails the open (ELOOP)."""
    return open(path, mode, opener=opener(os.O_RDONLY), **kwargs)


def open_lock(path: str):
    """`path` open to lock it and write its holder into it (created if absent); a link there fails (ELOOP)."""
    return open(path, "r+", encoding="utf-8", opener=opener(os.O_RDWR | os.O_CREAT))


def opener(flags: int):
    """An `opener` for open() that opens with `flags`, never following a link (open's own flags would)."""
    return lambda path, _: os.open(path, flags | NO_LINK, 0o666)


def new_folder(path: str) -> None:
    """An empty folder at `path`, made afresh: what was there (a folder, a file, a link) is removed first."""
    remove(path)
    os.mkdir(path)


def real_folders(top: str, below: str) -> str:
    """`top`/`below` as folders for another library's code to write into, which follows whatever it finds: each
    folder below `top` on the way is made if absent, and a link in place of one is removed as a link, never walked
    into. Returns the path."""
    os.makedirs(top, exist_ok=True)  # the output folder: where the user put it (a link there is the user's choice)
    path = top
    for name in os.path.normpath(below).split(os.sep):
        path = os.path.join(path, name)
        if os.path.islink(path):
            # Said, not silent: a user may have linked it to a larger disk on purpose.
            print(f"warning: {path} was a symbolic link (to {os.readlink(path)}); removed, never written through: "
                  f"a run writes inside its output folder", file=sys.stderr)
            remove(path)
        if not os.path.lexists(path):
            os.mkdir(path)
    return path


def make_folders(path: str) -> list[str]:
    """`path` and its missing parents made (as os.makedirs, which says why it cannot); the folders this call made
    itself, innermost first: a failed command removes those that are still empty (remove_empty)."""
    missing, folder = [], os.path.abspath(path)
    while not os.path.lexists(folder) and folder != os.path.dirname(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    made = []
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process: not this call's
            os.mkdir(folder)
            made.insert(0, folder)
    os.makedirs(path, exist_ok=True)  # a file in the way is refused here, as os.makedirs refuses it
    return made


def remove_empty(folders: list[str]) -> None:
    """Remove `folders` (innermost first), each only while it is empty: rmdir itself refuses one that is not, and
    the folders around it are then kept too."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            return


def give_usual_modes(folder: str) -> None:
    """Every file under `folder` gets the mode a file created here gets, 0666 less the umask (0644 under the usual
    022): some writers create theirs through a private temporary file, 0600 (safetensors' model.safetensors), and
    a folder's files should read alike. Links are left alone (never followed)."""
    mode = 0o666 & ~umask()
    for parent, _, names in os.walk(folder):
        for name in names:
            try:
                fd = os.open(os.path.join(parent, name), os.O_RDONLY | NO_LINK)
            except OSError:  # a link (ELOOP): not this folder's file to change
                continue
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)


def umask() -> int:
    """This process's umask, read where Linux shows it, without setting it (os.umask sets it to read it: another
    thread creating a file meanwhile would get the wrong mode)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(path: str, obj, advice: str = "free space or make the folder writable, then run again") -> None:
    """Write through a temporary file and a rename, so readers never see half a file (and never through a
    symbolic link)."""
    with replacing(path, encoding="utf-8", advice=advice) as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


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
