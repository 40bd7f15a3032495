"""What scoring through `evaluate` costs an evaluation: train.py's own `evaluate` over the same held-out rows, its
scores fed to the evaluate modules (add_batch after each batch, then compute, as a run does) or kept in Python lists
and scored by the same scikit-learn calls directly (how scores were computed before they were evaluate modules).

    python -m benchmarks.evaluation                      # 10,000 rows of the default corpus, the default model
    python -m benchmarks.evaluation --rows 2000 --repeats 3 --output_dir bench_out/evaluation

One process; the two ways alternate, each measured --repeats times after one warm-up evaluation, and the table
shows their medians. Writes DIR/evaluation.md (the table, with date and machine) and DIR/evaluation.json.
"""

import argparse
import importlib.metadata
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from accelerate import Accelerator
from datasets import concatenate_datasets

import train
from textclf.config import DEFAULT_DATA, TrainConfig
from textclf.data import length_sorted_loader, load_splits, tokenize
from textclf.models import build_job
from textclf.tasks import Task

from .measure import describe_machine


class ListsAndScikitLearn:
    """The scorer train.py's `evaluate` fed before scores were evaluate modules: the predictions in lists, scored
    once by the module's own computation (scikit-learn's calls), without evaluate's buffers around it."""

    def __init__(self, task: Task):
        self.module, self.predictions, self.references = task.evaluation_module(), [], []

    def add_batch(self, predictions: list, references: list) -> None:
        self.predictions += predictions
        self.references += references

    def compute(self) -> dict:
        scores = self.module._compute(self.predictions, self.references)
        self.predictions, self.references = [], []
        return scores


def measure(rows: int, repeats: int, data: str) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="textclf-evaluation-") as scratch:
        cfg = TrainConfig(data=data, cache_dir=str(Path(scratch) / "cache"), output_dir=str(Path(scratch) / "out"),
                          report_to=["none"])
        accelerator = Accelerator(cpu=True)
        task = Task.from_config(cfg)
        job = build_job(cfg)
        table, _, _ = load_splits(data, None, task, None, cfg.seed)
        table = concatenate_datasets([table] * -(-rows // len(table))).select(range(rows))
        loader = accelerator.prepare(length_sorted_loader(tokenize(table, job.tokenizer, cfg.max_length),
                                                          job.tokenizer, cfg.per_device_eval_batch_size))
        model = accelerator.prepare(job.model)
        ways = {"evaluate modules (add_batch, compute)": lambda: task.scores_with([]),
                "lists and scikit-learn": lambda: ListsAndScikitLearn(task)}
        for scorer in ways.values():  # warm-up: kernels, caches, imports
            train.evaluate(model, loader, accelerator, task, scorer())
        seconds = {way: [] for way in ways}
        scores = {}
        for _ in range(repeats):
            for way, scorer in ways.items():
                start = time.perf_counter()
                scores[way] = train.evaluate(model, loader, accelerator, task, scorer())
                seconds[way].append(time.perf_counter() - start)
    assert len({json.dumps(s, sort_keys=True) for s in scores.values()}) == 1, scores  # the same scores either way
    return [{"way": way, "rows": rows, "median_s": statistics.median(times), "runs_s": times,
             "scores": scores[way]} for way, times in seconds.items()]


def table(results: list[dict], machine: dict) -> list[str]:
    base = results[-1]["median_s"]
    versions = ", ".join(f"{name} {version}" for name, version in machine["versions"].items() if version)
    lines = [f"Measured {machine['date']} on {machine['cpu']} ({machine['logical_cores']} logical cores; {versions}, "
             f"evaluate {importlib.metadata.version('evaluate')}); one process, {results[0]['rows']:,} rows, medians "
             f"of {len(results[0]['runs_s'])}.",
             "", "| scores kept and computed by | one evaluation, s | vs lists and scikit-learn |", "|---|---|---|"]
    lines += [f"| {r['way']} | {r['median_s']:.2f} | {r['median_s'] / base - 1:+.1%} |" for r in results]
    return lines


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000, help="held-out rows one evaluation scores")
    parser.add_argument("--repeats", type=int, default=5, help="evaluations per way, alternating")
    parser.add_argument("--data", default=DEFAULT_DATA, help="train.py's --data, whose rows are repeated to --rows")
    parser.add_argument("--output_dir", default="bench_out/evaluation")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    results = measure(args.rows, args.repeats, args.data)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = table(results, describe_machine())
    (out / "evaluation.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "evaluation.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
