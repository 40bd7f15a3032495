"""The evaluation loop: the task's scores over the whole eval set, every process evaluating its shard."""

import torch
from tqdm.auto import tqdm

from .task import Task


def evaluate_model(model, loader, accelerator, task: Task) -> dict:
    """The task's scores as eval_<key>, and eval_samples: the eval set's size (`gather_for_metrics` drops the
    samples that the last batch repeats to even out the shards)."""
    predictions_all, references_all = [], []
    was_training = model.training
    model.eval()
    # no_grad, not inference_mode: ZeRO-3 gathers parameters during the forward pass.
    with torch.no_grad():
        # A bar like training's, below it while it runs, gone after: an evaluation takes a while on a large eval set.
        for batch in tqdm(loader, desc="eval", unit="batch", leave=False,
                          disable=not accelerator.is_local_main_process):
            predictions = task.predictions(model(**batch).logits)
            predictions, references = accelerator.gather_for_metrics((predictions, task.targets(batch["labels"])))
            predictions_all += predictions.tolist()
            references_all += references.tolist()
    model.train(was_training)
    scores = task.compute_scores(predictions_all, references_all)
    return {**{f"eval_{key}": value for key, value in scores.items()}, "eval_samples": len(references_all)}
