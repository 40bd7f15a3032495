"""--overwrite_output_dir over a folder that holds a previous run: the run moved aside whole, or with --resume of one
of its checkpoints the checkpoints after it, into <output_dir>.replaced-<time>/ (checkpoint.claim_output_dir calls
these under the folder's lock). Imported only under --overwrite_output_dir."""

import os
import time

from .errors import InputError


def aside_folder(output_dir: str) -> str:
    return f"{os.path.normpath(output_dir)}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"


def move_run_aside(output_dir: str) -> None:
    """Rename output_dir aside and make it again, empty."""
    aside = aside_folder(output_dir)
    try:
        os.rename(output_dir, aside)
    except OSError as e:
        raise InputError(f"--overwrite_output_dir: cannot move the previous run in {output_dir} aside to "
                         f"{aside} ({e.strerror}); move or delete it yourself") from None
    os.makedirs(output_dir, exist_ok=True)  # another run may have made it meanwhile: the lock decides
    print(f"--overwrite_output_dir: moved the previous run in {output_dir} aside to {aside} (delete it "
          "when you no longer need it)")


def move_aside(output_dir: str, names: list[str]) -> None:
    """Move the folders `names` of output_dir aside."""
    if not names:
        return
    aside = aside_folder(output_dir)
    try:
        os.makedirs(aside, exist_ok=True)
        for name in names:
            os.rename(os.path.join(output_dir, name), os.path.join(aside, name))
    except OSError as e:
        raise InputError(f"--overwrite_output_dir: cannot move {', '.join(names)} of {output_dir} aside to {aside} "
                         f"({e.strerror}); move or delete them yourself") from None
    print(f"--overwrite_output_dir: moved {', '.join(names)} of {output_dir} aside to {aside} (delete it when you no "
          "longer need it)")
