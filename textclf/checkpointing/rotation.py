"""Checkpoints rotated: the ones past --save_total_limit are deleted (the `keep` newest, the best and the one resumed
from are kept), each through a rename first (folders.delete_folder).
"""

import os
from typing import Optional

from .folders import complete_checkpoints, delete_folder
from .verify import read_position


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
