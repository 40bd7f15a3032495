"""The data stage at scale: how long train.py takes from launch to its first optimizer step, and its peak
memory, on a data file repeated to each size, with empty caches and then again with the caches warm.

    python -m benchmarks.data_stage --data reviews.csv --text_column review --label_column label
    python -m benchmarks.data_stage --rows 60000,250000 --output_dir bench_out/data_stage

Each size gets caches of its own (tokenizer and `datasets`) under the output folder, so its first run
starts empty; evaluation is a fixed held-out file of the first rows, so it costs the same at every size.
Writes DIR/data_stage.md (the table, with date and machine) and DIR/data_stage.json. CPU time (the run's
processes together) and the load average before each run tell a busy machine's figures from an idle one's.
"""

import argparse
import json
import os
import resource
import sys
from pathlib import Path
from typing import Optional

import datasets

from textclf.config import DEFAULT_DATA
from textclf.data import load_table

from .measure import describe_machine, run_sampled

DEFAULT_ROWS = (60_000, 250_000, 1_000_000)
EVAL_ROWS = 1000


def write_files(data: str, rows: int, folder: Path) -> tuple[Path, Path]:
    """(`data`'s rows repeated in order until there are `rows`, its first EVAL_ROWS rows), as CSV files."""
    table = load_table(data)
    train_file, eval_file = folder / "train.csv", folder / "eval.csv"
    copies = -(-rows // len(table))
    datasets.concatenate_datasets([table] * copies).select(range(rows)).to_csv(str(train_file), index=False)
    table.select(range(min(EVAL_ROWS, len(table)))).to_csv(str(eval_file), index=False)
    return train_file, eval_file


def first_step_s(output_dir: Path, launched_at: float) -> float:
    with open(output_dir / "log.jsonl", encoding="utf-8") as f:
        return json.loads(f.readline())["time"] - launched_at


def cpu_s_of_children() -> float:
    """User and system CPU seconds of the processes this one has waited for, and of those they waited for
    (train.py and its tokenizing workers): on a shared machine, CPU time says what wall time cannot."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(data: str, rows: int, columns: list[str], folder: Path) -> list[dict]:
    """The first run (empty caches) and the second (warm) on `rows` rows."""
    folder.mkdir(parents=True, exist_ok=True)
    train_file, eval_file = write_files(data, rows, folder)
    results = []
    os.environ["HF_DATASETS_CACHE"] = str(folder / "datasets")  # the runs' own `datasets` cache, empty at first
    for run in ("first", "second"):
        output_dir = folder / f"run_{run}"
        cmd = [sys.executable, "train.py", "--data", str(train_file), "--eval_data", str(eval_file), *columns,
               "--max_steps", "1", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
               "--cache_dir", str(folder / "tokenizers"), "--output_dir", str(output_dir), "--overwrite_output_dir"]
        load, cpu_before = os.getloadavg()[0], cpu_s_of_children()
        sampled = run_sampled(cmd, folder / f"console_{run}.txt", timeout_s=3600)
        if sampled["exit_code"] != 0:
            raise SystemExit(f"error: the {run} run on {rows:,} rows failed; see {folder / f'console_{run}.txt'}")
        results.append({"rows": rows, "run": run, "first_step_s": first_step_s(output_dir, sampled["launched_at"]),
                        "wall_s": sampled["wall_s"], "cpu_s": cpu_s_of_children() - cpu_before,
                        "peak_rss_mb": max(sampled["peak_rss_mb_per_rank"]), "load_before": load})
    return results


def table(results: list[dict], machine: dict) -> list[str]:
    lines = [f"{machine['date']}, {machine['cpu']}, {machine['logical_cores']} logical cores, "
             f"{machine['memory_gb']} GB", "",
             "| training rows | caches | launch to first optimizer step | whole run | CPU time | peak memory | "
             "load before |", "|---|---|---|---|---|---|---|"]
    for row in results:
        caches = "empty (first run)" if row["run"] == "first" else "warm (second run)"
        lines.append(f"| {row['rows']:,} | {caches} | {row['first_step_s']:.0f} s | {row['wall_s']:.0f} s | "
                     f"{row['cpu_s']:.0f} s | {row['peak_rss_mb'] / 1024:.2f} GB | {row['load_before']:.1f} |")
    return lines


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=DEFAULT_DATA, help="the file to repeat (train.py's --data)")
    parser.add_argument("--text_column", default="review")
    parser.add_argument("--label_column", default="label")
    parser.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help="sizes, comma-separated")
    parser.add_argument("--output_dir", default="bench_out/data_stage")
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    columns = ["--text_column", args.text_column, "--label_column", args.label_column]
    results = []
    for rows in map(int, args.rows.split(",")):
        results += measure(args.data, rows, columns, out / f"rows_{rows}")
        print("\n".join(table(results[-2:], describe_machine())[2:]), flush=True)
    (out / "data_stage.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    (out / "data_stage.md").write_text("\n".join(table(results, describe_machine())) + "\n", encoding="utf-8")
    print(f"wrote {out / 'data_stage.md'}")


if __name__ == "__main__":
    main()
