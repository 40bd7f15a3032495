"""The best checkpoint put back at the end of a run (--load_best_model_at_end): imported only then, and by a resume
that must find it."""

import json
import os

from accelerate import Accelerator

from .checkpoint import POSITION, checkpoint_folder, read_verified_position, write_json
from .errors import InputError, checked_on_main_process
from .task import format_score


def find_best_checkpoint(best: dict, output_dir: str) -> str:
    """The best checkpoint's folder: in the folder the run goes on in (which may have been moved), else where
    it was saved (a run resumed into another --output_dir)."""
    for folder in (checkpoint_folder(output_dir, best["step"]), best["checkpoint"]):
        if os.path.exists(os.path.join(folder, POSITION)):
            return folder
    raise InputError(f"the best checkpoint so far (step {best['step']}, saved as {best['checkpoint']}) is neither "
                     f"there nor in {output_dir}: put it back in either place, or leave out --load_best_model_at_end")


def load_best(accelerator: Accelerator, best: dict, step: int, output_dir: str) -> dict:
    """Put the best checkpoint's weights into the model (unless they are the ones at hand), record in
    run.json which step they are from, and return their evaluation."""
    checkpoint = find_best_checkpoint(best, output_dir) if best["step"] != step else None
    if checkpoint:
        from .integrity import verify_checkpoint

        checked_on_main_process(accelerator, lambda: verify_checkpoint(checkpoint, read_verified_position(checkpoint)))
        accelerator.load_state(checkpoint)
    if accelerator.is_main_process:
        path = os.path.join(output_dir, "run.json")
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
        run["best_model"] = {"step": best["step"], "checkpoint": checkpoint, **best["metrics"]}
        write_json(path, run)
    scores = ", ".join(f"{k} {format_score(v)}" for k, v in best["metrics"].items() if k != "eval_samples")
    accelerator.print(f"best model: step {best['step']} ({scores})"
                      + (f", loaded from {checkpoint}" if checkpoint else ", the last step"))
    return best["metrics"]
