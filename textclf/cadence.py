"""When train.py evaluates, saves and stops: the Trainer's eval/save strategies, the best model, early stopping.

The best evaluation so far travels in every checkpoint's position.json, so a resumed run keeps counting patience
and knows which checkpoint to export (textclf/best_model.py loads it).
"""

from typing import Optional

from .errors import InputError


def due(strategy: str, every: Optional[int], step: int, steps_per_epoch: int) -> bool:
    """Whether optimizer step `step` ends a period of `strategy`: accelerate syncs gradients at every epoch's end,
    so epoch e ends exactly at step (e + 1) x steps_per_epoch."""
    if strategy == "epoch":
        return step % steps_per_epoch == 0
    return strategy == "steps" and every is not None and step % every == 0


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


def patience_ran_out(best: Optional[dict], patience: Optional[int]) -> bool:
    return patience is not None and best is not None and best["evaluations_without_improvement"] >= patience
