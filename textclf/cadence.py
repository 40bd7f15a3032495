"""When train.py evaluates, saves and stops: the Trainer's eval/save strategies and early stopping. The best
evaluation so far (textclf/best_model.py) travels in every checkpoint's position.json, so a resumed run keeps
counting patience and knows which checkpoint to export."""

from typing import Optional


def due(strategy: str, every: Optional[int], step: int, steps_per_epoch: int) -> bool:
    """Whether optimizer step `step` ends a period of `strategy`: accelerate syncs gradients at every epoch's end,
    so epoch e ends exactly at step (e + 1) x steps_per_epoch."""
    if strategy == "epoch":
        return step % steps_per_epoch == 0
    return strategy == "steps" and every is not None and step % every == 0


def patience_ran_out(best: Optional[dict], patience: Optional[int]) -> bool:
    return patience is not None and best is not None and best["evaluations_without_improvement"] >= patience
