"""What a run killed while it saved, deleted or converted a checkpoint left in the output folder
(`.incomplete_step_<N>`, `.deleting_*`, `.universal_*`): removed when the next run claims the folder
(checkpoint.claim_output_dir), which imports this only when there is something to remove."""

import os

from . import files
from .checkpoint import LEFTOVERS
from .errors import write_failed


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
