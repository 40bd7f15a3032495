"""Evaluation: accuracy and macro-F1 through `evaluate`, from metric scripts that ship with the repo."""

import os

import evaluate
import torch

HERE = os.path.dirname(__file__)


def load_metric(name: str) -> evaluate.EvaluationModule:
    """A metric from the scripts beside this file: `evaluate.load("accuracy")` needs the Hub."""
    return evaluate.load(os.path.join(HERE, f"{name}.py"), keep_in_memory=True)


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
    return {"eval_accuracy": load_metric("accuracy").compute(predictions=predictions_all,
                                                             references=references_all)["accuracy"],
            "eval_f1": load_metric("f1").compute(predictions=predictions_all, references=references_all,
                                                 average="macro")["f1"],
            "eval_samples": len(references_all)}
