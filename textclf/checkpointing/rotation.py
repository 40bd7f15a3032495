"""Checkpoints deleted: the ones past --save_total_limit (rotate; the `keep` newest, the best and the one resumed from
are kept), and the old checkpoint of a step that a rerun saves again. Always through a rename first, so that a kill
mid-way never leaves a half-deleted folder under a checkpoint's name.
"""

import contextlib
import os
from typing import Optional

from textclf import files
from textclf.errors import write_failed

from .folders import DELETING, complete_checkpoints
from .verify import read_position


def delete_folder(path: str) -> None:
    """Delete a checkpoint folder: renamed to .deleting_<name>, then removed."""
    parent, name = os.path.split(os.path.normpath(path))
    doomed = os.path.join(parent, DELETING + name)
    try:  # a link in place of a checkpoint is removed as a link, never walked into
        with contextlib.suppress(OSError):
            files.remove(doomed)
        os.rename(path, doomed)
        files.remove(doomed)
    except OSError as e:
        raise write_failed("delete the checkpoint", path, e, f"make the folder writable (what is left of it is "
                           f"{doomed}, which the next start removes), then continue with --resume latest") from None


def rotate(output_dir: str, keep: int, metric: str, protect: Optional[str],
           greater_is_better: bool = True) -> list[str]:
    """Delete all but the `keep` newest checkpoints, the best one by `metric` (the task says which way is
    better), and `protect`."""
    found = complete_checkpoints(output_dir)
    kept = {path for _, path in found[-keep:]}
    scored = [(read_position(path).get("metrics", {}).get(metric), step, path) for step, path in found]
    scored = [(value if greater_is_better else -value, step, path) for value, step, path in scored if value is not None]
    if scored:
        kept.add(max(scored)[2])  # ties go to the newer checkpoint
    if protect:
        kept |= {path for _, path in found if os.path.realpath(path) == os.path.realpath(protect)}  # links too
    removed = [path for _, path in found if path not in kept]
    for path in removed:
        delete_folder(path)
    return removed
