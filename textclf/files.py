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
    file. A failed write is one line (errors.write_failed), and the temporary file is removed."""

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


def write_json(path: str, obj, advice: str = "free space or make the folder writable, then run again") -> None:
    """Write through a temporary file and a rename, so readers never see half a file (and never through a
    symbolic link: textclf/py)."""
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
