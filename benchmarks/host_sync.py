"""Does the loop wait for the device between log lines, and what would a wait every step cost? The step
time of train.py against a copy of it that makes the check train.py made before (an all-reduce of the
stop flag read back with `.item()` after every optimizer step), in alternating runs.

    python -m benchmarks.host_sync                                   # scratch-mini and scratch-base, bf16 on a GPU
    python -m benchmarks.host_sync --models scratch-tiny --steps 60 --log_every 20 --precision no   # a CPU

Each run trains --steps optimizer steps and logs every --log_every; the step time is the wall-clock time
between the first and the last log line over the steps between them (log.jsonl's `time`), so the first
steps (first allocations, first kernels of each sequence length) are left out. The copy lives in a
temporary folder for the runs, and differs from train.py by that one line.
Prints a table and writes <output_dir>/host_sync.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from textclf.data import DEFAULT_DATA

from .plan import OFFLINE, REPO

# The line of train.py that the copy replaces, and what replaces it: the check before d993e92.
QUIET = "            stopping = False\n"
EVERY_STEP = ("            stopping = accelerator.reduce(torch.tensor([float(bool(stop_requested))], "
              "device=accelerator.device), reduction=\"sum\").item() > 0\n")


def waiting_copy(folder: Path) -> Path:
    source = (REPO / "train.py").read_text(encoding="utf-8")
    if source.count(QUIET) != 1:
        raise SystemExit("error: train.py no longer holds the line this benchmark replaces; update QUIET")
    path = folder / "train_waiting_every_step.py"
    path.write_text(source.replace(QUIET, EVERY_STEP), encoding="utf-8")
    return path


def step_time(args, script: Path, model: str, output_dir: Path) -> dict:
    command = [sys.executable, str(script), "--model", model, "--data", args.data, "--max_steps", str(args.steps),
               "--logging_steps", str(args.log_every), "--save_strategy", "no", "--eval_strategy", "no",
               "--mixed_precision", args.precision, "--per_device_train_batch_size", str(args.batch),
               "--max_length", "128", "--report_to", "none", "--output_dir", str(output_dir), "--overwrite_output_dir"]
    # The copy runs from a temporary folder: textclf is imported from the repository, as train.py's own is.
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **OFFLINE, "PYTHONPATH": path}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: {script.name} --model {model} failed:\n{done.stderr[-3000:]}")
    lines = [row for row in map(json.loads, (output_dir / "log.jsonl").read_text().splitlines()) if "loss" in row]
    first, last = lines[0], lines[-1]
    steps = last["step"] - first["step"]
    tokens = sum(row["real_tokens_per_s"] for row in lines[1:]) / len(lines[1:])
    return {"ms_per_step": 1000 * (last["time"] - first["time"]) / steps, "real_tokens_per_s": tokens}


def each(runs: list[dict]) -> str:
    return " ".join(f"{run['ms_per_step']:.2f}" for run in runs)


def main(argv=None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_sync", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="scratch-mini,scratch-base", help="comma-separated --model values")
    parser.add_argument("--data", default=DEFAULT_DATA, help="training data (train.py's columns; default: its own)")
    parser.add_argument("--steps", type=int, default=250, help="optimizer steps per run")
    parser.add_argument("--log_every", type=int, default=50, help="--logging_steps of each run")
    parser.add_argument("--batch", type=int, default=32, help="--per_device_train_batch_size")
    parser.add_argument("--precision", default="bf16" if torch.cuda.is_available() else "no",
                        help="--mixed_precision (default: bf16 on a GPU, else no)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each; the table shows medians")
    parser.add_argument("--output_dir", default="bench_out/host_sync")
    args = parser.parse_args(argv)
    if args.steps < 2 * args.log_every:
        parser.error("--steps must hold at least two log lines after the first step: 2 x --log_every or more")
    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="host_sync_") as folder:
        scripts = {"train.py": REPO / "train.py", "waiting every step": waiting_copy(Path(folder))}
        for model in args.models.split(","):
            for repeat in range(args.repeats):
                for name, script in scripts.items():
                    measured = step_time(args, script, model, out / f"{model}_{len(results)}")
                    results.setdefault(f"{model}|{name}", []).append(measured)
                    print(f"[host_sync] {model} {name} run {repeat + 1}: {measured['ms_per_step']:.2f} ms/step",
                          flush=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    lines = [f"{device}, --mixed_precision {args.precision}, {args.steps} steps of {args.batch}, timed from step "
             f"{args.log_every} to {args.steps}; medians of {args.repeats}", "",
             "| model | train.py: ms/step | waiting every step: ms/step | train.py: real tok/s | each run, ms/step |",
             "|---|---|---|---|---|"]
    for model in args.models.split(","):
        now, waiting = results[f"{model}|train.py"], results[f"{model}|waiting every step"]
        lines.append(f"| {model} | {statistics.median(r['ms_per_step'] for r in now):.2f} | "
                     f"{statistics.median(r['ms_per_step'] for r in waiting):.2f} | "
                     f"{statistics.median(r['real_tokens_per_s'] for r in now):,.0f} | "
                     f"{each(now)} / {each(waiting)} |")
    (out / "host_sync.json").write_text(json.dumps({"device": device, "args": vars(args), "runs": results}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
