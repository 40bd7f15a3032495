"""What a killed run left in the output folder: what it was saving, deleting or converting (`.incomplete_step_<N>`,
`.deleting_*`, `.universal_*`), removed when the next run claims the folder (checkpoint.claim_output_dir), and what
it logged after its last checkpoint, cut from log.jsonl on resume. Imported only when there is something to remove."""

import json
import os
import sys

from . import files
from .checkpoint import LEFTOVERS
from .errors import InputError, write_failed


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


def cut_log(path: str, step: int) -> None:
    """On resume, forget what a killed run logged after its checkpoint (tracking.keep_log_until), so that the log
    at `path` reads as one run.

    A last line cut short (a kill while appending) is dropped with a warning; a damaged line anywhere
    else is not the trace of a kill, and stops the run.
    """
    try:
        with files.open_existing(path) as f:  # a link in its place is refused, not read and replaced
            lines = [line for line in f.read().split(b"\n") if line.strip()]
    except OSError as e:
        raise write_failed("rewrite", path, e, "make it a file of this run's, then resume again") from None
    kept = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line.decode("utf-8"))
            logged_at = row["step"]
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError):
            if number < len(lines):
                raise InputError(f"{path} line {number} is damaged (not a JSON object with a step): repair or "
                                 "delete that line, then resume again") from None
            print(f"warning: {path}: dropped its last line, cut short by the end of the previous run: "
                  f"{line[:80]!r}", file=sys.stderr)
            continue
        if logged_at <= step:
            kept.append(line + b"\n")
    with files.replacing(path, "wb", what="rewrite", advice="free space or make it writable, then resume again") as f:
        f.writelines(kept)
