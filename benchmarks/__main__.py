"""Benchmark: one training job under every strategy this machine can run, each measured the same way.

    python -m benchmarks                       # default sizes: under 20 minutes on a 2-core CPU
    python -m benchmarks --quick               # a smaller job and fewer rows
    python -m benchmarks --data my.csv --output_dir bench_out --only single,plain_pytorch
    python -m benchmarks --only single,plain_pytorch --repeats 5   # medians of 5 alternating runs

Rows, each a subprocess started the way a user starts it, one after another:
- train.py: `single` (`python train.py`, one process, fp32), `lora` (`--lora`), and one row per zoo
  file in accelerate_configs/ that runs here (`accelerate launch --config_file ...`), plus `cpu_bf16`
  (cpu.yaml with `--mixed_precision bf16`); files that need CUDA or several machines are listed
  with the reason they were skipped.
- the baselines of benchmarks/baselines.py: `plain_pytorch` (a hand-written loop on the same
  batches), `hf_trainer` (transformers.Trainer, settings equal to train.py's), `hf_trainer_default`.
- on a GPU, `single_bf16`, `plain_pytorch_bf16` and `hf_trainer_bf16`: the same three in bf16 autocast,
  held against the GPU's bf16 matmul rate.
A job trains one epoch of a seeded sample of the data, so every row trains on the same examples,
in whatever order its sampler draws them. A second job trains a BERT-base-sized model (built from
config, no download) through train.py and the plain loop, to compare model FLOP/s with the FLOP/s
torch reaches on a large fp32 matmul, and, in full mode, under DDP, ZeRO-2 and ZeRO-3 to put ZeRO's
memory savings beside the theory. Before the rows, the padding of one epoch of the whole data in
train.py's order, the Trainer's and a random one (lengths only, no training).

With --repeats N, the rows run N rounds, alternating, so that a slow spell of the machine falls on
every row alike; each row shows its run of median speed, beside the speeds of all its runs.

Writes DIR/bench.md (tables), DIR/bench.json (a list of rows), DIR/bench.png (throughput and
memory per strategy), and DIR/runs/<row>/ (each run's log.jsonl; its console output beside it in
<row>.console.log; with --repeats, under DIR/runs/round_<k>/).
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from textclf.config import DEFAULT_DATA, TrainConfig
from textclf.errors import run_command
from textclf.launch import scoped

from .measure import (
    describe_machine,
    epoch_padding,
    job_data,
    limit_of,
    matmul_limit,
    median_run,
    prepare_job,
    run_row,
    stop_on_signals,
    warm_deepspeed_ops,
)
from .plan import OFFLINE, REPO, plan_jobs, plan_rows, rounds_dirs
from .report import write_report


def say(line: str) -> None:
    """What the benchmark is doing, a line per stage: before its first row there are minutes of preparation."""
    print(f"[bench] {line}", flush=True)


@scoped
def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller job and fewer rows")
    parser.add_argument("--output_dir", default="bench_out", help="where bench.md, bench.json, bench.png go")
    parser.add_argument("--data", default=DEFAULT_DATA, help="training data with train.py's columns (label, review)")
    parser.add_argument("--only", help="comma-separated row names to run (default: all that run here)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the rows this many rounds, alternating, and show each row's median run")
    parser.add_argument("--steps", type=int, help="optimizer steps of the first job's rows (default: the job's, "
                                                  "61 with --quick: a warm-up step and 60 measured)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.steps is not None and args.steps < 2:
        parser.error("--steps must be at least 2: the first step is a warm-up, left out of the speeds")
    stop_on_signals()
    os.environ.update({k: v for k, v in OFFLINE.items() if k not in os.environ})
    out_dir = Path(args.output_dir).resolve()
    data = str(Path(args.data).resolve()) if args.data != DEFAULT_DATA else args.data
    os.chdir(REPO)  # where train.py runs, and where the default data is built
    cuda_devices = torch.cuda.device_count()
    only = set(args.only.split(",")) if args.only else None
    known = {row["name"] for job in plan_jobs(args.quick, args.steps) for row in plan_rows(job, cuda_devices)}
    if only and only - known:
        parser.error(f"unknown row(s) {', '.join(sorted(only - known))}; known: {', '.join(sorted(known))}")

    say(f"the padding of one epoch of {data} in three orders (lengths only, no training)")
    machine = describe_machine()
    padding = epoch_padding(TrainConfig(data=data))
    matmul_repeats = 5 if args.quick else 10
    say("the machine's fp32 matmul rate, which each row's model FLOP/s is held against")
    # The machine's speed drifts (other tenants of a VM), so the limit is measured before the first row and
    # after every row, and each row is held against the higher of the two measurements around it.
    matmuls = [matmul_limit(matmul_repeats)]
    print(f"[bench] matmul limit {matmuls[0]['flops_per_s'] / 1e9:.1f} GFLOP/s", flush=True)

    def run_measured(row, job, files, shape, runs_dir):
        result = run_row(row, job, files, shape, runs_dir)
        matmuls.append(matmul_limit(matmul_repeats))
        result["matmul_limit"] = max(matmuls[-2:], key=lambda m: limit_of(row, m))
        return result

    sections = []
    with tempfile.TemporaryDirectory(prefix="textclf-bench-") as scratch:
        for job in plan_jobs(args.quick, args.steps):
            rows = plan_rows(job, cuda_devices)
            if only is not None:
                rows = [row for row in rows if row["name"] in only]
            if not rows:
                continue
            say(f"job {job.model}: its data and model prepared (the tokenizer learnt, the examples tokenized) for "
                f"{len(rows)} row(s)")
            files = job_data(job, data, scratch)
            shape = prepare_job(job, *files)
            deepspeed_rows = [r for r in rows if r.get("zero_stage") is not None and "skipped" not in r]
            if deepspeed_rows:
                say("DeepSpeed's CPU ops compiled, or loaded from their cache")
            deepspeed_ops = warm_deepspeed_ops() if deepspeed_rows else None
            section = {"job": job, "shape": shape, "rows": [], "data_name": data, "deepspeed_ops": deepspeed_ops}
            sections.append(section)
            rounds = []
            for runs_dir in rounds_dirs(out_dir / "runs", args.repeats):
                rounds.append([])
                for number, row in enumerate(rows, start=1):
                    say(f"row {number} of {len(rows)}" + (f", round {len(rounds)} of {args.repeats}" if args.repeats > 1
                                                          else "") + f": {row['name']}"
                        + (f" skipped ({row['skipped']})" if "skipped" in row else ""))
                    rounds[-1].append(row if "skipped" in row else run_measured(row, job, files, shape, runs_dir))
                    # Written after every row: a benchmark stopped or failed later keeps the rows it finished.
                    section["rows"] = [median_run([runs[i] for runs in rounds if i < len(runs)])
                                       for i in range(len(rounds[0]))]
                    write_report(out_dir, machine, matmuls, padding, sections, argv)
    failed = [r["name"] for s in sections for r in s["rows"] if r.get("status") == "failed"]
    print(f"[bench] wrote {out_dir}/bench.md, bench.json, bench.png" + (f"; failed: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    run_command(main)  # bad input (data, columns): one `error:` line, exit code 2
