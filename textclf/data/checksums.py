"""The files `datasets` caches (the table read from a data file, its columns chosen, and the tokenized examples),
trusted only as they were written: beside each, the size and sha256 it had then; at a later run a file whose size or
sha256 differs, or that has no record, is removed and made again from the data, in one line, never trained on.
"""

import contextlib
import fcntl
import json
import os
import time
from contextlib import contextmanager
from typing import Callable

from accelerate import PartialState
from datasets import Dataset

from textclf import files
from textclf.errors import InputError

# Beside each cache file, what it held when it was written: {"size": bytes, "sha256": hex}.
CHECKSUM_SUFFIX = ".sha256.json"


@contextmanager
def one_run_at_a_time(cache: str):
    """An OS lock beside `cache` while this run checks, writes and records it; none where the folder or its file
    system takes none (two runs on one data set at once may then rebuild each other's cache)."""
    with contextlib.ExitStack() as held:
        try:
            fcntl.flock(held.enter_context(files.open_lock(cache + ".lock")), fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def verified_table(make: Callable[[bool], Dataset], what: str) -> Dataset:
    """`make(False)`'s table, whose cache files are trusted only as they were written: the files it read from the
    cache are checked against their records, and where one is damaged (or has none) they are removed and the table
    made again with `make(True)`, which reads nothing from the cache. `what`: what the cache holds, for the line
    that says so. Under a launch the local main process alone checks and records; the others make the table after
    it (the caller's local_main_process_first) and read what it checked."""
    if not PartialState().is_local_main_process:
        return make(False)
    started = time.time()
    table = make(False)
    cached = [entry["filename"] for entry in table.cache_files]
    read = [file for file in cached if os.path.getmtime(file) < started]  # the others, this call wrote
    if read:
        with one_run_at_a_time(read[0]):
            problems = cache_problems(read)
            if problems:
                remove_damaged(problems, what, "reading it again")
                started, table = time.time(), make(True)
                cached = [entry["filename"] for entry in table.cache_files]
    with one_run_at_a_time(cached[0]) if cached else contextlib.nullcontext():
        record_checksums([file for file in cached if os.path.getmtime(file) >= started], what)
    return table


def remove_damaged(problems: dict[str, tuple[str, str]], what: str, then: str) -> None:
    """Say in one line that the cache of `what` is damaged (cache_problems' first, and how many more) and what the
    run does `then`; remove each damaged file and its record."""
    (name, (state, detail)), more = next(iter(problems.items())), len(problems) - 1
    print(f"data: the cache of {what} in {os.path.dirname(name)} {state} ({os.path.basename(name)}: {detail}"
          f"{f'; and {more} more of its files' if more else ''}); {then}", flush=True)
    for file in problems:
        try:
            files.remove(file + CHECKSUM_SUFFIX)
            files.remove(file)
        except OSError as e:
            raise InputError(f"cannot remove {file}, a damaged cache of {what}: {e.strerror}; remove it yourself (or "
                             "make its folder writable), then run again") from None


def cache_problems(found: list[str]) -> dict[str, tuple[str, str]]:
    """(what the cache is, why) for each of the files `found` whose size or sha256 is not what its record says, that
    has no record, or that cannot be read. Only files of the recorded size are hashed."""
    problems, to_hash = {}, {}
    for file in found:
        record = checksum_record(file)
        if isinstance(record, str):
            problems[file] = ("is unverified", record)
            continue
        try:
            size = os.path.getsize(file)
        except OSError as e:
            problems[file] = ("cannot be read", e.strerror or str(e))
            continue
        if size != record["size"]:
            problems[file] = ("is damaged", f"{size:,} bytes where {record['size']:,} were written")
        else:
            to_hash[file] = record["sha256"]
    for (file, recorded), digest in zip(to_hash.items(), files.sha256_all(list(to_hash))):
        if isinstance(digest, OSError):
            problems[file] = ("cannot be read", digest.strerror or str(digest))
        elif digest != recorded:
            problems[file] = ("is damaged", "its sha256 is not the one recorded when it was written")
    return dict(sorted(problems.items()))


def checksum_record(file: str):
    """The size and sha256 recorded beside a cache file, or why there is none to trust."""
    try:
        with files.open_existing(file + CHECKSUM_SUFFIX, "r", encoding="utf-8") as f:
            record = json.load(f)
        return {"size": int(record["size"]), "sha256": str(record["sha256"])}
    except FileNotFoundError:
        return "no checksum was recorded beside it when it was written"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its checksum record does not read ({getattr(e, 'strerror', None) or e})"


def record_checksums(written: list[str], what: str) -> None:
    """Record beside each newly written cache file its size and sha256, each in one rename."""
    for file, digest in zip(written, files.sha256_all(written)):
        if isinstance(digest, OSError):
            raise InputError(f"cannot read {file}, the cache of {what} just written: {digest.strerror}; check the "
                             "disk, then run again")
        files.write_json(file + CHECKSUM_SUFFIX, {"size": os.path.getsize(file), "sha256": digest})
