"""Checkpoints: where a run starts (fresh, or the checkpoint --resume names) and what a resume trusts; `step_<N>/`
folders written whole or not at all and sealed by position.json; each verified before anything of it loads; the
output folder that one run at a time owns; rotation. Light: nothing here imports torch at the top, so a resume that
this launch cannot continue is refused before the heavy imports.

A checkpoint is what `accelerator.save_state` writes plus position.json: the loop position, what the run is made of,
its evaluation, config and loss windows, and the size and sha256 of every file, signed with this user's secret (so it
proves that this user's run wrote it) and sealed by a sha256 of its own.
"""

from .folders import (
    FSDP_SHARDED,
    POSITION,
    STEP_DIR,
    checkpoint_folder,
    complete_checkpoints,
    find_best_checkpoint,
    step_folders,
)
from .output_dir import claim_output_dir, find_checkpoint
from .pickles import refuse_pickle_unless_allowed, weights_only_loads
from .resume import (
    RESUME_TABLE,
    Start,
    batch_split,
    check_against,
    needs_universal,
    plan_start,
    resolve,
    resuming,
)
from .rotation import delete_folder, rotate
from .verify import authorship, read_position, read_verified_position, verified_best_checkpoint, verify_checkpoint
from .write import continue_advice, sealed_checkpoint

__all__ = [
    "FSDP_SHARDED", "POSITION", "RESUME_TABLE", "STEP_DIR", "Start", "authorship", "batch_split", "check_against",
    "checkpoint_folder", "claim_output_dir", "complete_checkpoints", "continue_advice", "delete_folder",
    "find_best_checkpoint", "find_checkpoint", "needs_universal", "plan_start", "read_position",
    "read_verified_position", "refuse_pickle_unless_allowed", "resolve", "resuming", "rotate", "sealed_checkpoint",
    "step_folders", "weights_only_loads",
    "verified_best_checkpoint", "verify_checkpoint",
]
