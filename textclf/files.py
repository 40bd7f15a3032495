"""Writing into folders that other users may share (an output_dir on a group's scratch space): a run never
writes through a symbolic link that someone put in place of one of its files or folders.

A file is written under a temporary name created afresh (O_CREAT | O_EXCL | O_NOFOLLOW: whatever was at that
name is removed first, and a link planted there meanwhile fails the open) and then renamed to its final name
with os.replace, which replaces a link at the final name instead of following it. A file that is opened in
place (the lock, log.jsonl) is opened with O_NOFOLLOW: a link there is refused (errors.write_failed says so). A
folder is made afresh with os.mkdir, and a link in place of a folder is removed as a link, never walked into.
"""

import contextlib
import os
import shutil

# Open flags for a file this process writes, never through a link; O_CLOEXEC: no child process inherits it.
NO_LINK = os.O_NOFOLLOW | os.O_CLOEXEC


def remove(path: str) -> None:
    """Remove what is at `path`: a file or a link (the link itself, not what it points to), or a folder and
    everything in it. Nothing there is not an error."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def open_new(path: str, mode: str = "w", **kwargs):
    """A new file at `path`, open for writing (`mode`: "w" or "wb", and open's keyword arguments): what was at
    `path` is removed first, and the file is created exclusively, so a link planted there meanwhile fails the
    open instead of being written through."""
    remove(path)
    return open(path, mode, opener=opener(os.O_WRONLY | os.O_CREAT | os.O_EXCL), **kwargs)


@contextlib.contextmanager
def replacing(path: str, mode: str = "w", *, advice: str, what: str = "write", suffix: str = ".tmp", **kwargs):
    """A new file (open_new) that replaces `path` in one rename when the block ends, so that readers never see
    half a file. A write that fails is one line (errors.write_failed: `what`, `path`, then `advice`), and the
    temporary file is removed."""
    from .errors import write_failed

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
    """`path` open for reading and writing (created if absent), to lock it and write its holder into it; a link
    at `path` fails the open (ELOOP)."""
    return open(path, "r+", encoding="utf-8", opener=opener(os.O_RDWR | os.O_CREAT))


def opener(flags: int):
    """An `opener` for open() that opens with `flags`, never following a link (open's own flags would)."""
    return lambda path, _: os.open(path, flags | NO_LINK, 0o666)


def new_folder(path: str) -> None:
    """An empty folder at `path`, made afresh: what was there (a folder, a file, a link) is removed first."""
    remove(path)
    os.mkdir(path)
