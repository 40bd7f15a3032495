"""Evaluation: accuracy and macro-F1 through `evaluate`, from a metric script that ships with the repo."""

import os

import evaluate
import torch

HERE = os.path.dirname(__file__)


def classification_scores(predictions: list[int], references: list[int], labels=None) -> dict:
    """{"accuracy", "f1" (macro)} from the metric script beside this file: `evaluate.load("accuracy")`
    needs the Hub."""
    metric = evaluate.load(os.path.join(HERE, "classification.py"), keep_in_memory=True)
    return metric.compute(predictions=predictions, references=references, labels=labels)


def evaluate_model(model, loader, accelerator) -> dict:
    """Scores over the whole eval set, every process evaluating its shard.

    `gather_for_metrics` drops the samples that the last batch repeats to even out the shards, so
    the count equals the eval set's size.
    """
    predictions_all, references_all = [], []
    was_training = model.training
    model.eval()
    # no_grad, not inference_mode: ZeRO-3 gathers parameters during the forward pass.
    with torch.no_grad():
        for batch in loader:
            predictions = model(**batch).logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            predictions_all += predictions.tolist()
            references_all += references.tolist()
    model.train(was_training)
    scores = classification_scores(predictions_all, references_all)
    return {"eval_accuracy": scores["accuracy"], "eval_f1": scores["f1"], "eval_samples": len(references_all)}
