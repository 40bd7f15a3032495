"""The best checkpoint (--load_best_model_at_end): tracked at each evaluation and put back at the end of the run.
Imported only with that flag, and by a resume that must find it."""

import json
import os
from typing import Optional

from accelerate import Accelerator

from .checkpoint import POSITION, checkpoint_folder, write_json
from .errors import InputError, checked_on_main_process
from .task import format_score


def track_best(best: Optional[dict], step: int, metrics: dict, metric: str, checkpoint: str,
               greater_is_better: bool = True) -> Optional[dict]:
    """The best evaluation after this one (`checkpoint`: where this step's is or would be saved), and how many in
    a row did not improve on it. As in the Trainer's EarlyStoppingCallback, only a strictly better value counts;
    a tie moves the best to the newer checkpoint, the one rotation keeps. None (a correlation of constant
    predictions) improves on nothing."""
    if metric not in metrics:
        raise InputError(f"metric_for_best_model {metric} is not one of the evaluation's: {', '.join(metrics)}")
    value = metrics[metric]
    if value is None:
        return None if best is None else {**best, "evaluations_without_improvement":
                                          best["evaluations_without_improvement"] + 1}
    improved = best is None or (value > best["value"] if greater_is_better else value < best["value"])
    waited = 0 if improved else best["evaluations_without_improvement"] + 1
    if improved or value == best["value"]:
        return {"step": step, "value": value, "metrics": metrics, "checkpoint": checkpoint,
                "evaluations_without_improvement": waited}
    return {**best, "evaluations_without_improvement": waited}


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
        from .integrity import read_verified_position, verify_checkpoint

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
