"""Where checkpoints are, by name: the `step_<N>/` folders of an output folder, which of them are complete (they
hold position.json, written last), and the names of what a killed run leaves.
"""

from __future__ import annotations

import os
import re

POSITION = "position.json"

# Where accelerate's save_state puts FSDP's sharded model state (f"{FSDP_MODEL_NAME}_0"; test_users checks it):
# a torch.distributed.checkpoint folder, whose metadata file torch reads with full pickle.
FSDP_SHARDED = "pytorch_model_fsdp_0"

STEP_DIR = re.compile(r"^step_(\d+)$")

INCOMPLETE = ".incomplete_"  # + step_<N>: a checkpoint being written

DELETING = ".deleting_"  # + step_<N>: a checkpoint being deleted

UNIVERSAL = ".universal_"  # + step_<N>: a ZeRO checkpoint converted for another number of processes

# What runs killed while saving, deleting or converting a checkpoint leave: the next run that claims the folder
# removes it.
LEFTOVERS = (INCOMPLETE, DELETING, UNIVERSAL)

LOCK = ".lock"  # held (flock) by the main process of the run that owns the folder


def checkpoint_folder(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"step_{step}")


def step_folders(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every step_<N> folder in output_dir, oldest first."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return sorted((int(match.group(1)), os.path.join(output_dir, name))
                  for name in names if (match := STEP_DIR.match(name)))


def complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in output_dir, oldest first."""
    return [(step, path) for step, path in step_folders(output_dir) if os.path.isfile(os.path.join(path, POSITION))]


