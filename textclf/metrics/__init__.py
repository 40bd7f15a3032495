"""Evaluation: each task's scores through `evaluate`, from a metric script that ships with the repo."""

import os
from typing import Optional

import evaluate
import torch

from ..task import Task

HERE = os.path.dirname(__file__)


def compute_scores(kind: str, predictions: list, references: list, labels=None) -> dict:
    """The scores of task `kind` (textclf/task.py) from the metric script beside this file, whose config
    is the task: `evaluate.load("accuracy")` and its kind need the Hub."""
    metric = evaluate.load(os.path.join(HERE, "scores.py"), config_name=kind, keep_in_memory=True)
    return metric.compute(predictions=predictions, references=references, **({"labels": labels} if labels else {}))


def classification_scores(predictions: list[int], references: list[int], labels=None) -> dict:
    """{"accuracy", "f1" (macro)}: single-label scores, as benchmarks/baselines.py asks for them."""
    return compute_scores("single_label", predictions, references, labels)


def evaluate_model(model, loader, accelerator, task: Optional[Task] = None) -> dict:
    """The task's scores over the whole eval set as eval_<key>, and eval_samples; every process evaluates
    its shard. Without a task: single-label (as the benchmark's Trainer baseline calls it).

    `gather_for_metrics` drops the samples that the last batch repeats to even out the shards, so
    the count equals the eval set's size.
    """
    task = task or Task("single_label", text_column="text", label_column="label")
    predictions_all, references_all = [], []
    was_training = model.training
    model.eval()
    # no_grad, not inference_mode: ZeRO-3 gathers parameters during the forward pass.
    with torch.no_grad():
        for batch in loader:
            predictions = task.predictions(model(**batch).logits)
            predictions, references = accelerator.gather_for_metrics((predictions, task.targets(batch["labels"])))
            predictions_all += predictions.tolist()
            references_all += references.tolist()
    model.train(was_training)
    scores = compute_scores(task.kind, predictions_all, references_all)
    return {**{f"eval_{key}": value for key, value in scores.items()}, "eval_samples": len(references_all)}
