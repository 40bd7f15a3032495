"""The best checkpoint (--load_best_model_at_end): tracked at each evaluation, travelling in every checkpoint's
position.json (a resumed run keeps counting patience and knows which checkpoint to export), and recorded once its
weights are back in the model at the end of the run."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Optional

from textclf.errors import InputError
from textclf.files import write_json
from textclf.tasks import format_score

if TYPE_CHECKING:
    from accelerate import Accelerator


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


def record_best_model(accelerator: Accelerator, best: dict, checkpoint: Optional[str], output_dir: str) -> dict:
    """Once the best checkpoint's weights are in the model (`checkpoint`: loaded from there, or None: the last
    step's), record in run.json which step they are from, say so, and return their evaluation."""
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
