"""What the benchmark runs: its jobs, the rows of each job (one per way of training it), and the
command that launches each row the way a user launches it."""

import dataclasses
import importlib.util
import json
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from textclf.launch import zero_offload

from .baselines import BASELINES

REPO = Path(__file__).resolve().parents[1]
ZOO = REPO / "accelerate_configs"
# The zoo files that run without CUDA (ranks over gloo); every other file needs GPUs.
CPU_ZOO = ("cpu", "zero2", "zero2_offload", "zero3", "zero3_offload")
# No row may reach a hub: the benchmark works offline, like the template.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class BenchJob:
    """One training job, run unchanged under each of its rows.

    By default the job trains exactly one epoch: its training set is a seeded sample of
    steps x global_batch examples. So every row trains on the same examples, whatever order its
    sampler draws them in, and rows with different samplers (the Trainer's) compare on the same
    work, not on different slices of an epoch.
    """

    model: str
    steps: int  # optimizer steps
    eval_rows: int  # held-out examples for the final evaluation
    # Training examples; None: one epoch of `steps`. More, for a job whose rows all draw train.py's
    # batches, makes the length groups of its first steps as tight as a full data set's.
    train_rows: Optional[int] = None
    rows: Optional[tuple] = None  # the rows to run; None: all
    left_out: Optional[str] = None  # why the other rows do not run, to list them; None: do not list them
    suffix: str = ""  # appended to row names, so that rows of different jobs stay apart
    global_batch: int = 32
    max_length: int = 128
    seed: int = 42
    # Steps left out of the steady-state figures. The first pays for first allocations and lazy
    # inits; every length-grouped order (train.py's, the Trainer's) puts the batch holding the
    # longest example first, so all of them leave out alike.
    warmup_steps: int = 1

    @property
    def train_examples(self) -> int:
        return self.train_rows or self.steps * self.global_batch


def plan_jobs(quick: bool, steps: Optional[int] = None) -> list[BenchJob]:
    """The jobs to run; `steps` (--steps) replaces the first job's number of optimizer steps."""
    jobs = quick_jobs() if quick else full_jobs()
    return [dataclasses.replace(jobs[0], steps=steps), *jobs[1:]] if steps else jobs


def quick_jobs() -> list[BenchJob]:
    # 60 steady-state steps past the warm-up step: with 2 or 20, train.py against the plain loop moved by more than 3%
    # from one run to the next, as much as the difference the comparison is there to tell.
    return [BenchJob("scratch-mini", steps=61, eval_rows=48, left_out="left out by --quick",
                     rows=("single", "plain_pytorch", "hf_trainer", "single_bf16", "plain_pytorch_bf16",
                           "hf_trainer_bf16", "cpu", "zero2")),
            BenchJob("scratch-small", steps=2, eval_rows=48, rows=("single", "plain_pytorch"), suffix="_small")]


def full_jobs() -> list[BenchJob]:
    return [BenchJob("scratch-mini", steps=60, eval_rows=1000),
            BenchJob("scratch-base", steps=8, train_rows=2160, eval_rows=240,
                     rows=("single", "plain_pytorch", "single_bf16", "plain_pytorch_bf16", "cpu", "zero2", "zero3"),
                     suffix="_base")]


def plan_rows(job: BenchJob, cuda_devices: int) -> list[dict]:
    """Every row of the job: how it is launched, or why it cannot run here."""
    rows = [dict(name="single", what="python train.py", processes=1),
            *(dict(name=name, what=what, processes=1, baseline=name) for name, what in BASELINES.items()
              if name != "hf_trainer_fast"),  # the steady-state job's (benchmarks/steady.py)
            dict(name="lora", what="python train.py --lora", processes=1, train_args=["--lora"], lora=True)]
    # On a GPU the comparison that matters is in bf16: train.py, the plain loop and the Trainer, each autocast.
    bf16 = dict(processes=1, precision="bf16", train_args=["--mixed_precision", "bf16"],
                **({} if cuda_devices else {"skipped": "needs CUDA (bf16 on this CPU: cpu_bf16)"}))
    rows += [dict(name="single_bf16", what="python train.py --mixed_precision bf16", **bf16),
             *(dict(name=f"{name}_bf16", what=f"{BASELINES[name]}, bf16 autocast", baseline=name, **bf16)
               for name in ("plain_pytorch", "hf_trainer"))]
    for path in sorted(ZOO.glob("*.yaml")):
        row = zoo_row(path, cuda_devices)
        rows.append(row)
        if path.stem == "cpu":
            rows.append({**row, "name": "cpu_bf16", "what": f"accelerate launch {path.name} --mixed_precision bf16",
                         "precision": "bf16", "launch_args": ["--mixed_precision", "bf16"]})
    for row in rows:
        if job.global_batch % row["processes"] and "skipped" not in row:
            row["skipped"] = f"global batch {job.global_batch} does not split over {row['processes']} processes"
    if job.rows is not None:
        rows = [row if row["name"] in job.rows else {"skipped": job.left_out, **row} for row in rows
                if row["name"] in job.rows or job.left_out]
    for row in rows:
        row["name"] += job.suffix
        if "skipped" in row:
            row["status"] = "skipped"
    return rows


def zoo_row(path, cuda_devices: int) -> dict:
    """The row of one zoo file: launched with it, or why it cannot run here."""
    spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    row = dict(name=path.stem, what=f"accelerate launch {path.name}", config_file=str(path.relative_to(REPO)),
               processes=spec.get("num_processes", 1), precision=str(spec.get("mixed_precision", "no")),
               **deepspeed_settings(spec))
    if spec.get("num_machines", 1) > 1:
        row["skipped"] = f"needs {spec['num_machines']} machines"
    elif not cuda_devices and path.stem not in CPU_ZOO:
        row["skipped"] = "needs CUDA"
    elif row["zero_stage"] is not None and importlib.util.find_spec("deepspeed") is None:
        row["skipped"] = "needs DeepSpeed: pip install -e '.[deepspeed]'"
    elif cuda_devices and path.stem == "cpu":
        row["skipped"] = "CPU-only file: on a CUDA machine its ranks would go to the GPUs"
    elif cuda_devices and row["processes"] > 1:  # the GPU files name 8; use the GPUs there are
        row.update(processes=cuda_devices, launch_args=["--num_processes", str(cuda_devices)])
    return row


def deepspeed_settings(spec: dict) -> dict:
    """ZeRO stage and what is offloaded, read from the DeepSpeed JSON a zoo file points to."""
    ds_file = (spec.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if not ds_file:
        return dict(zero_stage=None, offload=[])
    with open(REPO / ds_file, encoding="utf-8") as f:
        zero = json.load(f).get("zero_optimization", {})
    offload = [part for part, device in zero_offload(zero).items() if device != "none"]
    return dict(zero_stage=zero.get("stage", 0), offload=offload)


def train_args(job: BenchJob, files: tuple[str, str], processes: int, output_dir: Path) -> list[str]:
    """train.py's options for this job (files: its training and evaluation data); the baselines take the same."""
    return ["--model", job.model, "--data", files[0], "--eval_data", files[1], "--max_length", str(job.max_length),
            "--per_device_train_batch_size", str(job.global_batch // processes), "--max_steps", str(job.steps),
            "--seed", str(job.seed), "--logging_steps", "1", "--save_strategy", "no",
            "--report_to", "none", "--output_dir", str(output_dir), "--overwrite_output_dir"]


def command(row: dict, args: list[str]) -> list[str]:
    if row.get("baseline"):
        return [sys.executable, "-m", "benchmarks.baselines", row["baseline"], *args, *row.get("train_args", [])]
    if not row.get("config_file"):
        return [sys.executable, "train.py", *args, *row.get("train_args", [])]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", row["config_file"],
            "--main_process_port", str(free_port()), *row.get("launch_args", []),
            "train.py", *args, *row.get("train_args", [])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rounds_dirs(runs_dir: Path, repeats: int) -> list[Path]:
    """Where each round's runs go: runs_dir itself for a single round, runs_dir/round_<k> for several."""
    return [runs_dir] if repeats == 1 else [runs_dir / f"round_{k}" for k in range(1, repeats + 1)]
