"""Checkpoints: where a run starts (fresh, or the checkpoint --resume names) and what a resume trusts; `step_<N>/`
folders written whole or not at all and sealed by position.json; each verified before anything of it loads; the
output folder that one run at a time owns; rotation. Light: nothing here imports torch at the top, so a resume that
this launch cannot continue is refused before the heavy imports.

A checkpoint is what `accelerator.save_state` writes plus position.json: the loop position, what the run is made of,
its evaluation, config and loss windows, and the size and sha256 of every file, signed with this user's secret (so it
proves that this user's run wrote it) and sealed by a sha256 of its own.
"""

from .folders import FSDP_SHARDED, POSITION, STEP_DIR, checkpoint_folder, complete_checkpoints
from .load import check_resume, resuming
from .output_dir import claim_output_dir
from .pickles import refuse_pickle_unless_allowed, weights_only_loads
from .plan import Start, plan_start, read_resume
from .rotation import rotate
from .verify import authorship, read_position, read_verified_position, verified_best_checkpoint, verify_checkpoint
from .write import continue_advice, sealed_checkpoint

__all__ = [
    "FSDP_SHARDED", "POSITION", "STEP_DIR", "authorship", "check_resume", "checkpoint_folder", "claim_output_dir",
    "complete_checkpoints", "continue_advice", "plan_start", "read_position", "read_resume", "read_verified_position",
    "refuse_pickle_unless_allowed", "resuming", "rotate", "sealed_checkpoint", "Start", "verified_best_checkpoint",
    "verify_checkpoint", "weights_only_loads",
]
