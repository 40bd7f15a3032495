"""Benchmark: one training job under every strategy this machine can run, each measured the same way.

    python -m textclf.bench                       # default sizes: under 20 minutes on a 2-core CPU
    python -m textclf.bench --quick               # a smaller job and fewer rows: under 3 minutes
    python -m textclf.bench --data my.csv --output_dir bench_out --only single,plain_pytorch
    python -m textclf.bench --only single,plain_pytorch --repeats 5   # medians of 5 alternating runs

Rows, each a subprocess started the way a user starts it, one after another:
- train.py: `single` (`python train.py`, one process, fp32), `lora` (`--lora`), and one row per zoo
  file in accelerate_configs/ that runs here (`accelerate launch --config_file ...`), plus `cpu_bf16`
  (cpu.yaml with `--mixed_precision bf16`); files that need CUDA or several machines are listed
  with the reason they were skipped.
- the baselines of textclf/bench_baselines.py: `plain_pytorch` (a hand-written loop on the same
  batches), `hf_trainer` (transformers.Trainer, settings equal to train.py's), `hf_trainer_default`.
A job trains one epoch of a seeded sample of the data, so every row trains on the same examples,
in whatever order its sampler draws them. A second job trains a BERT-base-sized model (built from
config, no download) through train.py and the plain loop, to compare model FLOP/s with the FLOP/s
torch reaches on a large fp32 matmul, and, in full mode, under DDP, ZeRO-2 and ZeRO-3 to put ZeRO's
memory savings beside the theory. Before the rows, the padding of one epoch of the whole data in
train.py's order, the Trainer's and a random one (lengths only, no training).

With --repeats N, the rows run N rounds, alternating, so that a slow spell of the machine falls on
every row alike; each row shows its run of median speed, beside the speeds of all its runs.

Writes DIR/bench.md (tables), DIR/bench.json (a list of rows), DIR/bench.png (throughput and
memory per strategy), and DIR/runs/<row>/ (each run's log.jsonl and console output; with
--repeats, DIR/runs/round_<k>/<row>/).
"""

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil
import torch
import yaml
from torch.utils.data import RandomSampler
from transformers.trainer_pt_utils import LengthGroupedSampler

from .bench_baselines import BASELINES
from .config import TrainConfig
from .errors import InputError, run_command
from .data import DEFAULT_DATA, EpochLengthGroupedSampler, load_table, select_columns
from .job import build_job
from .modeling import apply_lora, parameter_counts
from .runtime import zero_offload
from .theory import OFFLOADED_BY, model_state_bytes, training_flops_per_token

REPO = Path(__file__).resolve().parents[1]
ZOO = REPO / "accelerate_configs"
# The zoo files that run without CUDA (ranks over gloo); every other file needs GPUs.
CPU_ZOO = ("cpu", "zero2", "zero2_offload", "zero3", "zero3_offload")
# No row may reach a hub: the benchmark works offline, like the template.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
ROW_TIMEOUT_S = 900
SAMPLE_EVERY_S = 0.2


@dataclass(frozen=True)
class Job:
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


def plan_jobs(quick: bool) -> list[Job]:
    if quick:
        return [Job("scratch-mini", steps=6, eval_rows=48,
                    rows=("single", "plain_pytorch", "hf_trainer", "cpu", "zero2"), left_out="left out by --quick"),
                Job("scratch-small", steps=4, eval_rows=48, rows=("single", "plain_pytorch"), suffix="_small")]
    return [Job("scratch-mini", steps=60, eval_rows=1000),
            Job("scratch-base", steps=8, train_rows=2160, eval_rows=240,
                rows=("single", "plain_pytorch", "cpu", "zero2", "zero3"), suffix="_base")]


# --- which rows, and how each is launched ---------------------------------------------------------------

def plan_rows(job: Job, cuda_devices: int) -> list[dict]:
    """Every row of the job: how it is launched, or why it cannot run here."""
    rows = [dict(name="single", what="python train.py", processes=1),
            *(dict(name=name, what=what, processes=1, baseline=name) for name, what in BASELINES.items()),
            dict(name="lora", what="python train.py --lora", processes=1, train_args=["--lora"], lora=True)]
    for path in sorted(ZOO.glob("*.yaml")):
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


def deepspeed_settings(spec: dict) -> dict:
    """ZeRO stage and what is offloaded, read from the DeepSpeed JSON a zoo file points to."""
    ds_file = (spec.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if not ds_file:
        return dict(zero_stage=None, offload=[])
    with open(REPO / ds_file, encoding="utf-8") as f:
        zero = json.load(f).get("zero_optimization", {})
    offload = [part for part, device in zero_offload(zero).items() if device != "none"]
    return dict(zero_stage=zero.get("stage", 0), offload=offload)


def train_args(job: Job, files: tuple[str, str], processes: int, output_dir: Path) -> list[str]:
    """train.py's options for this job (files: its training and evaluation data); the baselines take the same."""
    return ["--model", job.model, "--data", files[0], "--eval_data", files[1], "--max_length", str(job.max_length),
            "--per_device_train_batch_size", str(job.global_batch // processes), "--max_steps", str(job.steps),
            "--seed", str(job.seed), "--logging_steps", "1", "--save_steps", str(job.steps + 1),  # no checkpoint
            "--report_to", "none", "--output_dir", str(output_dir), "--overwrite_output_dir"]


def command(row: dict, args: list[str]) -> list[str]:
    if row.get("baseline"):
        return [sys.executable, "-m", "textclf.bench_baselines", row["baseline"], *args]
    if not row.get("config_file"):
        return [sys.executable, "train.py", *args, *row.get("train_args", [])]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", row["config_file"],
            "--main_process_port", str(free_port()), *row.get("launch_args", []),
            "train.py", *args, *row.get("train_args", [])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- running one row: wall time and the memory of each rank ---------------------------------------------

def run_sampled(cmd: list[str], console: Path, timeout_s: float) -> dict:
    """Run `cmd`, sampling the resident memory of every rank (and its GPU memory) until it exits.

    A rank is a process that has RANK in its environment while its parent has not (the launcher);
    without a launcher the process itself is the only rank. Compilers that DeepSpeed starts inherit
    RANK from their rank and are not counted.
    """
    env = {**OFFLINE, **os.environ}
    peak_rss, peak_gpu, rank_of = {}, {}, {}
    launched_at = time.time()
    with open(console, "w", encoding="utf-8") as out:
        # A session of its own: a timeout (or Ctrl-C here) stops the launcher and all its ranks together.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        root = psutil.Process(proc.pid)
        try:
            while proc.poll() is None and time.time() - launched_at < timeout_s:
                gpu_memory = gpu_memory_by_pid() if torch.cuda.is_available() else {}
                tree = [root, *safe(root.children, recursive=True, default=[])]
                pids = {p.pid for p in tree}
                for p in tree:
                    rss = safe(lambda: p.memory_info().rss)
                    if rss is None:
                        continue
                    peak_rss[p.pid] = max(peak_rss.get(p.pid, 0), rss)
                    peak_gpu[p.pid] = max(peak_gpu.get(p.pid, 0), gpu_memory.get(p.pid, 0))
                    if p.pid not in rank_of:  # read until seen after exec: a fresh fork shows its parent's environment
                        rank = safe(lambda: p.environ().get("RANK"))
                        # Unknown (unreadable, or out of the tree) is not "no RANK": a rank's helper is no rank.
                        parent_env = safe(lambda: p.parent().environ()) if safe(p.ppid) in pids else None
                        if rank is not None and parent_env is not None and "RANK" not in parent_env:
                            rank_of[p.pid] = int(rank)
                time.sleep(SAMPLE_EVERY_S)
        finally:
            timed_out = proc.poll() is None
            if timed_out:
                safe(os.killpg, proc.pid, signal.SIGKILL)
                proc.wait()
    ranks = sorted(rank_of, key=rank_of.get) or [proc.pid]
    mb = 2 ** 20
    return {"launched_at": launched_at, "wall_s": time.time() - launched_at, "exit_code": proc.returncode,
            "timed_out": timed_out,
            "peak_rss_mb_per_rank": [round(peak_rss.get(pid, 0) / mb) for pid in ranks],
            "peak_device_mb_per_rank": [round(peak_gpu.get(pid, 0) / mb) for pid in ranks]
            if torch.cuda.is_available() else None}


def safe(fn, *args, default=None, **kwargs):
    """psutil calls on processes that may exit between two lines."""
    try:
        return fn(*args, **kwargs)
    except (psutil.Error, OSError):
        return default


def gpu_memory_by_pid() -> dict:
    """Device memory each process holds, in bytes (nvidia-smi: allocated plus the allocator's cache)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(pid): int(used) * 2 ** 20 for pid, used in (line.split(", ") for line in out.strip().splitlines())
            if used.strip().isdigit()}


def read_log(log_path: Path, launched_at: float, global_batch: int, warmup_steps: int) -> dict:
    """Steady-state figures from a run's log.jsonl (one line per optimizer step, then the eval line).

    Time runs between the step lines' wall-clock stamps, from the end of the last warm-up step to the
    end of the last step: everything the loop does per step counts, evaluation and export do not.
    Each step line gives rates over its step; their ratios give the step's counts exactly:
    real tokens per sample = real_tokens_per_s / samples_per_s, and a full step has global_batch samples.
    A log that lacks the warm-up boundary, a steady step or the final evaluation raises.
    """
    with open(log_path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    steps = [line for line in lines if "samples_per_s" in line]
    evals = [line for line in lines if "eval_accuracy" in line]
    steady = [line for line in steps if line["step"] > warmup_steps]
    start = next(line["time"] for line in steps if line["step"] == warmup_steps)
    seconds = steady[-1]["time"] - start
    tokens_per_sample = [line["real_tokens_per_s"] / line["samples_per_s"] for line in steady]
    real = global_batch * sum(tokens_per_sample)
    padded = global_batch * sum(t / line["real_token_fraction"] for t, line in zip(tokens_per_sample, steady))
    times = [start] + [line["time"] for line in steady]
    return {"startup_s": steps[0]["time"] - launched_at, "steps_per_s": len(steady) / seconds,
            "samples_per_s": global_batch * len(steady) / seconds, "real_tokens_per_s": real / seconds,
            "real_token_fraction": real / padded, "tokens_per_sample": real / (global_batch * len(steady)),
            "eval_accuracy": evals[-1]["eval_accuracy"],
            "step_seconds": [b - a for a, b in zip(times, times[1:])],
            "losses": [line.get("loss") for line in steps]}


def run_row(row: dict, job: Job, files: tuple[str, str], shape: dict, runs_dir: Path) -> dict:
    """Run one row and turn its measurements into the row's figures."""
    output_dir = runs_dir / row["name"]
    shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.mkdir(parents=True)
    cmd = command(row, train_args(job, files, row["processes"], output_dir))
    print(f"[bench] {row['name']}: {' '.join(cmd[1:])}", flush=True)
    result = {**row, "model": job.model, "command": " ".join(["python", *cmd[1:]]),
              **run_sampled(cmd, output_dir / "console.log", ROW_TIMEOUT_S)}
    result["peak_rss_mb"] = max(result["peak_rss_mb_per_rank"])
    if result["peak_device_mb_per_rank"] is not None:
        result["peak_device_mb"] = max(result["peak_device_mb_per_rank"])
    lora = row.get("lora", False)
    result["theory_model_states_mb"] = round(device_state_bytes(
        params=shape["lora_params" if lora else "params"],
        trainable=shape["lora_trainable" if lora else "params"], processes=row["processes"],
        zero_stage=row.get("zero_stage"), offload=row.get("offload", []),
        mixed=row.get("zero_stage") is not None and row.get("precision", "no") in ("bf16", "fp16"),
        on_gpu=torch.cuda.is_available()) / 2 ** 20, 1)
    try:
        if result["timed_out"]:
            raise TimeoutError(f"stopped after {ROW_TIMEOUT_S} s")
        result.update(read_log(output_dir / "log.jsonl", result["launched_at"], job.global_batch, job.warmup_steps))
    except (TimeoutError, OSError, StopIteration, IndexError, KeyError, ZeroDivisionError, json.JSONDecodeError) as e:
        tail = (output_dir / "console.log").read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
        result.update(status="failed", reason=f"exit {result['exit_code']}, no complete log ({type(e).__name__} {e}): "
                                              + " | ".join(tail))
        return result
    result["status"] = "ok"
    if result["exit_code"] != 0:  # DeepSpeed sometimes aborts after the script finished (NOTES.md)
        result["reason"] = f"exit code {result['exit_code']} after the run"
    result["model_flops_per_s"] = model_flops_per_token(shape, lora, result["tokens_per_sample"]) \
        * result["real_tokens_per_s"]
    return result


def rounds_dirs(runs_dir: Path, repeats: int) -> list[Path]:
    """Where each round's runs go: runs_dir itself for a single round, runs_dir/round_<k> for several."""
    return [runs_dir] if repeats == 1 else [runs_dir / f"round_{k}" for k in range(1, repeats + 1)]


def median_run(runs: list[dict]) -> dict:
    """One row's repeated runs as one: the run of median steady-state speed (the slower middle one of an
    even number), with every round's speeds in `steps_per_s_runs` and `real_tokens_per_s_runs` (None for
    a failed run), so that two rows' lists pair round by round."""
    ok = [r for r in runs if r.get("status") == "ok"]
    if len(runs) == 1 or not ok:
        return runs[-1]
    chosen = sorted(ok, key=lambda r: r["steps_per_s"])[(len(ok) - 1) // 2]
    return {**chosen, **{f"{key}_runs": [r.get(key) if r.get("status") == "ok" else None for r in runs]
                         for key in ("steps_per_s", "real_tokens_per_s")},
            "failed_runs": len(runs) - len(ok)}


def measured(speeds: list) -> list[float]:
    return [speed for speed in speeds if speed is not None]


# --- model FLOPs and ZeRO memory: the theory -----------------------------------------------------------

def model_flops_per_token(shape: dict, lora: bool, tokens_per_sample: float) -> float:
    """Training FLOPs per real token of the job's model (textclf.theory); LoRA trains the adapters and head only."""
    trainable = shape["lora_trainable"] if lora else shape["non_embedding_params"]
    return training_flops_per_token(shape["non_embedding_params"], trainable, shape["layers"], shape["hidden"],
                                    tokens_per_sample)


def device_state_bytes(params: int, trainable: int, processes: int, zero_stage: Optional[int], offload: list,
                       mixed: bool, on_gpu: bool) -> float:
    """The model states one rank holds in its device's memory (textclf.theory): offloaded parts leave
    a GPU but stay in the host's memory, so on a CPU they still count."""
    parts = model_state_bytes(params, trainable, world=processes, stage=zero_stage or 0, sixteen_bit=mixed)
    return sum(n for part, n in parts.items() if not (on_gpu and OFFLOADED_BY.get(part) in offload))


def matmul_limit(repeats: int) -> dict:
    """FLOP/s torch reaches on a large fp32 matmul here: the ceiling for model FLOP/s (median of repeats)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = 8192 if device == "cuda" else 2048
    a, b = (torch.randn(size, size, device=device) for _ in range(2))
    seconds = []
    for i in range(repeats + 3):  # three warm-up products
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            seconds.append(time.perf_counter() - start)
    return {"size": size, "repeats": repeats, "threads": torch.get_num_threads(), "device": device,
            "flops_per_s": 2 * size ** 3 / statistics.median(seconds)}


# --- data and model, prepared once per job ------------------------------------------------------------

def job_data(job: Job, data: str, folder: str) -> tuple[str, str]:
    """The job's training and evaluation files: disjoint seeded samples of `data`, written as CSV.

    The training file holds exactly job.train_examples examples.
    """
    defaults = TrainConfig()
    table = select_columns(load_table(data), data, defaults.text_column, defaults.label_column)
    needed = job.train_examples + job.eval_rows
    if len(table) < needed:
        raise InputError(f"{data} has {len(table)} examples with text; the benchmark's {job.model} job needs "
                         f"{needed} ({job.train_examples} to train {job.steps} steps, {job.eval_rows} to evaluate)")
    table = table.shuffle(seed=job.seed).rename_column("text", defaults.text_column)
    paths = []
    for split, rows in (("train", range(job.eval_rows, needed)), ("eval", range(job.eval_rows))):
        paths.append(os.path.join(folder, f"{Path(data).stem}_{job.model}_{split}_{len(rows)}.csv"))
        table.select(rows).to_csv(paths[-1], index=False)
    return paths[0], paths[1]


def prepare_job(job: Job, train_file: str, eval_file: str) -> dict:
    """Tokenizer and tokenized data made once here, so that no row's startup pays for them; the model's shape."""
    cfg = TrainConfig(model=job.model, data=train_file, eval_data=eval_file, max_length=job.max_length, seed=job.seed)
    built = build_job(cfg)
    counts = parameter_counts(built.model)
    config = built.model.config
    lora = parameter_counts(apply_lora(built.model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
                                       cfg.lora_target_modules))
    return {"train_examples": len(built.train_set), "eval_examples": len(built.eval_set), "params": counts["params"],
            "non_embedding_params": counts["params"] - counts["embedding"], "layers": config.num_hidden_layers,
            "hidden": config.hidden_size, "lora_params": lora["params"], "lora_trainable": lora["trainable"]}


PADDING_ORDERS = {  # name: the batch order
    "train.py": "train.py's length groups (the default)",
    "hf_trainer": "the Trainer's `group_by_length`",
    "random": "random batches (`--no_group_by_length`; the Trainer's default)",
}


def epoch_padding(cfg: TrainConfig) -> dict:
    """How much of what a model processes is real over one epoch of `python train.py` with `cfg`.

    The training split, tokenizer, micro-batch and max_length are cfg's (train.py's defaults unless
    changed); only the order of the batches changes, one order per PADDING_ORDERS entry. Lengths
    alone decide a batch's padding, so no model runs.
    """
    lengths = build_job(cfg).train_set["length"][:]
    batch = cfg.per_device_train_batch_size
    samplers = {
        "train.py": EpochLengthGroupedSampler(lengths, batch, cfg.seed),
        "hf_trainer": LengthGroupedSampler(batch, lengths=lengths, generator=torch.Generator().manual_seed(cfg.seed)),
        "random": RandomSampler(lengths, generator=torch.Generator().manual_seed(cfg.seed)),
    }
    fractions = {}
    for name, sampler in samplers.items():
        order = [lengths[i] for i in sampler]
        batches = [order[i:i + batch] for i in range(0, len(order), batch)]
        fractions[name] = sum(order) / sum(len(b) * max(b) for b in batches)  # padded to its longest
    return {"data": cfg.data, "examples": len(lengths), "batch": batch, "max_length": cfg.max_length,
            "real_token_fraction": fractions}


def warm_deepspeed_ops() -> str:
    """Build DeepSpeed's C++ ops (scripts/warm_deepspeed_ops.py) before the rows: no row's startup compiles."""
    start = time.time()
    try:
        done = subprocess.run([sys.executable, "scripts/warm_deepspeed_ops.py"], cwd=REPO, capture_output=True,
                              text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return "timed out after 900 s (the rows build what they need)"
    if done.returncode:
        return f"failed ({(done.stderr.strip().splitlines() or [str(done.returncode)])[-1]})"
    return f"{time.time() - start:.0f} s"


# --- the machine, and the report ----------------------------------------------------------------------

def describe_machine() -> dict:
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    versions = {"python": platform.python_version()}
    for package in ("torch", "accelerate", "transformers", "datasets", "deepspeed", "peft"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"), "cpu": cpu,
            "logical_cores": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
            "memory_gb": round(psutil.virtual_memory().total / 2 ** 30, 1), "gpus": gpus, "versions": versions,
            "os": platform.platform()}


def peak_mb(row: dict) -> int:
    """The memory that limits a run: the GPU's where there is one, else the host's."""
    return row.get("peak_device_mb", row["peak_rss_mb"])


def fmt(value, digits=1) -> str:
    if value is None:
        return ""
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def rows_table(rows: list[dict]) -> list[str]:
    device = "device" if torch.cuda.is_available() else "RSS"
    head = ["row", "what runs", "procs", "startup s", "steps/s", "samples/s", "real tok/s", "real-token frac",
            "model GFLOP/s", "of matmul limit", f"peak {device} MB/rank", "theory states MB/rank", "eval acc", "wall s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("status") != "ok":
            reason = r.get("skipped") or r.get("reason")
            out.append(f"| {r['name']} | {r['what']} | {r['processes']} | " + f"{r.get('status', 'skipped')}: "
                       f"{reason} |" + " |" * (len(head) - 4))
            continue
        memory = r["peak_device_mb_per_rank"] or r["peak_rss_mb_per_rank"]
        note = f" ({r['reason']})" if r.get("reason") else ""
        if r.get("failed_runs"):
            note += f" ({r['failed_runs']} of its runs failed)"
        speed = fmt(r["steps_per_s"], 2)
        if "steps_per_s_runs" in r:
            speed += f" ({min(measured(r['steps_per_s_runs'])):.2f}-{max(measured(r['steps_per_s_runs'])):.2f})"
        out.append("| " + " | ".join([
            r["name"], r["what"] + note, str(r["processes"]), fmt(r["startup_s"]), speed,
            fmt(r["samples_per_s"]), fmt(r["real_tokens_per_s"], 0), fmt(r["real_token_fraction"], 3),
            fmt(r["model_flops_per_s"] / 1e9), f"{r['limit_fraction']:.0%}", " / ".join(map(str, memory)),
            fmt(r["theory_model_states_mb"]), fmt(r["eval_accuracy"], 4), fmt(r["wall_s"])]) + " |")
    return out


def compare_with_plain(rows: list[dict], suffix: str) -> list[str]:
    """train.py (single) against the plain loop on the same batches: losses, and step time paired step by step."""
    by_name = {r["name"]: r for r in rows if r.get("status") == "ok"}
    ours, plain = by_name.get("single" + suffix), by_name.get("plain_pytorch" + suffix)
    if not ours or not plain:
        return []
    pairs = [(a, b) for a, b in zip(ours["losses"], plain["losses"]) if a is not None and b is not None]
    loss_gap = max(abs(a - b) for a, b in pairs)
    ratios = [a / b for a, b in zip(ours["step_seconds"], plain["step_seconds"])]
    return [f"train.py `single{suffix}` against `plain_pytorch{suffix}`, same batches in the same order: "
            f"largest per-step loss difference {loss_gap:.2g} over {len(pairs)} steps; steady-state step time "
            f"{plain['steps_per_s'] / ours['steps_per_s']:.3f}x the plain loop's in total, "
            f"{statistics.median(ratios):.3f}x as the median of per-step ratios"
            + over_rounds(plain, ours, "steps_per_s", "step time"), ""]


def compare_with_trainer(rows: list[dict], suffix: str) -> list[str]:
    """train.py (single) against the Trainer rows in real tokens/s: the same examples, one epoch, each in its order."""
    by_name = {r["name"]: r for r in rows if r.get("status") == "ok"}
    ours = by_name.get("single" + suffix)
    lines = []
    for trainer in (by_name.get(name + suffix) for name in ("hf_trainer", "hf_trainer_default")):
        if ours and trainer:
            ratio = ours["real_tokens_per_s"] / trainer["real_tokens_per_s"]
            lines += [f"train.py `{ours['name']}` against `{trainer['name']}` ({trainer['what']}), the same examples "
                      f"in one epoch: real tokens/s {ours['real_tokens_per_s']:,.0f} against "
                      f"{trainer['real_tokens_per_s']:,.0f}, **{ratio:.3f}x**"
                      + over_rounds(ours, trainer, "real_tokens_per_s", "real tokens/s"), ""]
    return lines


def over_rounds(a: dict, b: dict, key: str, what: str) -> str:
    """With --repeats: a's speed over b's as the ratio of their median runs, and round by round."""
    if f"{key}_runs" not in a or f"{key}_runs" not in b:
        return "."
    rounds = [x / y for x, y in zip(a[f"{key}_runs"], b[f"{key}_runs"]) if x and y]
    medians = [statistics.median(measured(row[f"{key}_runs"])) for row in (a, b)]
    return (f" (the median runs). Over {len(rounds)} alternating rounds: {what} {medians[0] / medians[1]:.3f}x as the "
            "ratio of median speeds; per round " + ", ".join(f"{x:.3f}" for x in rounds) + ".")


def memory_table(rows: list[dict]) -> list[str]:
    """ZeRO rows beside the DDP row of the same job: the theory's saving per rank, and what was measured."""
    by_name = {r["name"]: r for r in rows if r.get("status") == "ok"}
    reference = next((r for r in by_name.values() if r.get("zero_stage") is None and r["processes"] > 1
                      and r.get("precision", "no") == "no"), None)
    zero = [r for r in by_name.values() if r.get("zero_stage") is not None]
    if not reference or not zero:
        return []
    out = [f"Memory per rank against `{reference['name']}` (DDP, every rank holds everything):", "",
           "| row | ZeRO stage | offload | theory states MB/rank | theory saving MB | measured peak MB/rank "
           "| measured saving MB |", "|---|---|---|---|---|---|---|"]
    for r in [reference, *zero]:
        out.append(f"| {r['name']} | {r.get('zero_stage') or '-'} | {', '.join(r.get('offload', [])) or '-'} "
                   f"| {fmt(r['theory_model_states_mb'])} "
                   f"| {fmt(reference['theory_model_states_mb'] - r['theory_model_states_mb'])} "
                   f"| {peak_mb(r)} | {peak_mb(reference) - peak_mb(r)} |")
    return out + ["", MEMORY_NOTE, ""]


SETTINGS_NOTE = """\
Equal in every row of a job: the training and eval examples, tokenizer, model and its initial weights
(seed), sequence length, global batch, optimizer steps; in a one-epoch job every row trains on every
example once. train.py rows and `plain_pytorch` also share the batches themselves (textclf.data: same
collation, length grouping and order), fused AdamW with the same lr, weight decay, betas and eps,
the linear warmup schedule and gradient clipping. `hf_trainer` has those same settings through
TrainingArguments (`optim="adamw_torch_fused"`, `warmup_steps`, `train_sampling_strategy="group_by_length"`,
logging every step); its length-grouped batches are drawn by the Trainer's own sampler.
`hf_trainer_default` keeps only model, data, batch, steps and seed: lr 5e-5, no warmup, no weight
decay, random batches, fused AdamW, logging every 500 steps."""

MEMORY_NOTE = """\
Why measured and theory differ: a rank's peak holds, besides the model states, the Python process and
its libraries (most of it for a small model), activations, and buffers the theory leaves out: DDP's
gradient buckets (4 more bytes per parameter), ZeRO-2's own fp32 copy of its weight partition (kept
even in fp32 training: 4/N bytes per parameter), DeepSpeed's flattened copies and communication
buckets. Offload moves states from GPU memory to host memory, so on a CPU it saves nothing."""

HOW_NOTE = """\
How to read it: startup is launch to the end of the first optimizer step. Steady state runs from the
end of the warm-up step (the batch with the longest example, first in every length-grouped order) to
the last step, by the wall-clock stamps of log.jsonl, so the loop's logging counts and evaluation and
export do not. Real tokens exclude padding. Model FLOP/s =
(6 x non-embedding parameters + 12 x layers x hidden x tokens per sample) x real tokens/s (LoRA:
4N + 2 x trainable), against the matmul limit measured just before or after the row, whichever is
higher (times the GPUs a GPU row uses). Peak memory is resident memory per rank on a CPU, sampled
every {every} s; on a GPU, the device memory each rank holds (nvidia-smi). Theory states: weights,
gradients and Adam states per rank by the ZeRO paper, 4+4+8 bytes per parameter in fp32, 2+2+12 in
mixed precision."""


def write_report(out_dir: Path, machine: dict, matmuls: list[dict], padding: dict, sections: list[dict],
                 argv: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [r for section in sections for r in section["rows"]]
    for r in (r for r in rows if r.get("status") == "ok"):
        # The CPU's limit is measured on all its cores, which every row uses; a GPU's is per GPU.
        devices = r["processes"] if r["matmul_limit"]["device"] == "cuda" else 1
        r["matmul_limit_flops_per_s"] = r["matmul_limit"]["flops_per_s"] * devices
        r["limit_fraction"] = r["model_flops_per_s"] / r["matmul_limit_flops_per_s"]
    matmul, limits = matmuls[0], sorted(m["flops_per_s"] / 1e9 for m in matmuls)
    with open(out_dir / "bench.json", "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    v = machine["versions"]
    lines = [f"# Benchmark: `python -m textclf.bench {' '.join(argv)}`".rstrip(), "",
             f"{machine['date']}; {machine['cpu']}, {machine['physical_cores']} cores ({machine['logical_cores']} "
             f"logical), {machine['memory_gb']} GB" + (f"; GPUs: {', '.join(machine['gpus'])}" if machine["gpus"] else
                                                        "; no GPU") + f"; {machine['os']}.",
             "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + ".",
             f"Matmul limit: {limits[0]:.1f} to {limits[-1]:.1f} GFLOP/s, median {statistics.median(limits):.1f} "
             f"(fp32 {matmul['size']}x{matmul['size']} on {matmul['device']}, {matmul['threads']} threads, median of "
             f"{matmul['repeats']} products; measured {len(matmuls)} times, before the first row and after each). "
             "Each row's fraction is against the higher of the measurements just before and after it.", "",
             *padding_table(padding)]
    for section in sections:
        job, shape = section["job"], section["shape"]
        lines += [f"## `{job.model}` on {Path(section['data_name']).name}", "",
                  f"{shape['params'] / 1e6:.1f}M parameters ({shape['non_embedding_params'] / 1e6:.1f}M outside "
                  f"embeddings; LoRA trains {shape['lora_trainable'] / 1e6:.2f}M); "
                  + ("one epoch: " if job.train_rows is None else "the first steps of an epoch of ")
                  + f"{shape['train_examples']} training examples (a seeded sample), {job.steps} optimizer steps of "
                  f"global batch {job.global_batch} "
                  f"(steady state over the last {job.steps - job.warmup_steps}); {shape['eval_examples']} eval "
                  f"examples; max_length {job.max_length}, seed {job.seed}."
                  + (f" DeepSpeed's C++ ops built or loaded before the rows: {section['deepspeed_ops']}."
                     if section["deepspeed_ops"] else ""), "",
                  *rows_table(section["rows"]), "", *compare_with_plain(section["rows"], job.suffix),
                  *compare_with_trainer(section["rows"], job.suffix),
                  *memory_table(section["rows"])]
    lines += [SETTINGS_NOTE, "", HOW_NOTE.format(every=SAMPLE_EVERY_S), ""]
    (out_dir / "bench.md").write_text("\n".join(lines), encoding="utf-8")
    plot(out_dir / "bench.png", sections[0], machine)


def padding_table(padding: dict) -> list[str]:
    return [f"## Padding over one epoch of {Path(padding['data']).name}, as `python train.py` trains it", "",
            f"{padding['examples']:,} training examples, micro-batch {padding['batch']}, max_length "
            f"{padding['max_length']}: the share of the tokens processed that are real, by batch order.", "",
            "| order | real-token fraction |", "|---|---|",
            *(f"| {PADDING_ORDERS[order]} | {fraction:.3f} |"
              for order, fraction in padding["real_token_fraction"].items()),
            ""]


def plot(path: Path, section: dict, machine: dict) -> None:
    """Throughput and memory per strategy, for the first job."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in section["rows"] if r.get("status") == "ok"]
    names = [r["name"] for r in rows]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.8), sharey=True)
    speed.barh(names, [r["samples_per_s"] for r in rows], color="tab:blue")
    speed.set_xlabel("samples/s (steady state)")
    for y, r in enumerate(rows):
        speed.annotate(f" {r['limit_fraction']:.0%} of matmul", (r["samples_per_s"], y), va="center", fontsize=8)
    memory.barh(names, [peak_mb(r) for r in rows], color="tab:orange", label="measured peak per rank")
    memory.scatter([r["theory_model_states_mb"] for r in rows], names, color="black", marker="|", s=200,
                   label="theory: weights + grads + Adam per rank", zorder=3)
    memory.set_xlabel("MB per rank")
    memory.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8)
    speed.margins(x=0.3)  # room for the labels
    speed.invert_yaxis()
    fig.suptitle(f"{section['job'].model}, global batch {section['job'].global_batch} - {machine['cpu']}, "
                 f"{machine['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m textclf.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller job and fewer rows (under 3 minutes)")
    parser.add_argument("--output_dir", default="bench_out", help="where bench.md, bench.json, bench.png go")
    parser.add_argument("--data", default=DEFAULT_DATA, help="training data with train.py's columns (label, review)")
    parser.add_argument("--only", help="comma-separated row names to run (default: all that run here)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the rows this many rounds, alternating, and show each row's median run")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that the running row is stopped too
    os.environ.update({k: v for k, v in OFFLINE.items() if k not in os.environ})
    out_dir = Path(args.output_dir).resolve()
    data = str(Path(args.data).resolve()) if args.data != DEFAULT_DATA else args.data
    os.chdir(REPO)  # where train.py runs, and where the default data is built
    cuda_devices = torch.cuda.device_count()
    only = set(args.only.split(",")) if args.only else None
    known = {row["name"] for job in plan_jobs(args.quick) for row in plan_rows(job, cuda_devices)}
    if only and only - known:
        parser.error(f"unknown row(s) {', '.join(sorted(only - known))}; known: {', '.join(sorted(known))}")

    machine = describe_machine()
    padding = epoch_padding(TrainConfig(data=data))
    matmul_repeats = 5 if args.quick else 10
    # The machine's speed drifts (other tenants of a VM), so the limit is measured before the first row and
    # after every row, and each row is held against the higher of the two measurements around it.
    matmuls = [matmul_limit(matmul_repeats)]
    print(f"[bench] matmul limit {matmuls[0]['flops_per_s'] / 1e9:.1f} GFLOP/s", flush=True)

    def run_measured(row, job, files, shape, runs_dir):
        result = run_row(row, job, files, shape, runs_dir)
        matmuls.append(matmul_limit(matmul_repeats))
        result["matmul_limit"] = max(matmuls[-2:], key=lambda m: m["flops_per_s"])
        return result

    sections = []
    with tempfile.TemporaryDirectory(prefix="textclf-bench-") as scratch:
        for job in plan_jobs(args.quick):
            rows = plan_rows(job, cuda_devices)
            if only is not None:
                rows = [row for row in rows if row["name"] in only]
            if not rows:
                continue
            files = job_data(job, data, scratch)
            shape = prepare_job(job, *files)
            deepspeed_rows = [r for r in rows if r.get("zero_stage") is not None and "skipped" not in r]
            deepspeed_ops = warm_deepspeed_ops() if deepspeed_rows else None
            rounds = [[row if "skipped" in row else run_measured(row, job, files, shape, runs_dir) for row in rows]
                      for runs_dir in rounds_dirs(out_dir / "runs", args.repeats)]
            results = [median_run(list(runs)) for runs in zip(*rounds)]
            sections.append({"job": job, "shape": shape, "rows": results, "data_name": data,
                             "deepspeed_ops": deepspeed_ops})
            # A partial report survives a later failure.
            write_report(out_dir, machine, matmuls, padding, sections, argv)
    failed = [r["name"] for s in sections for r in s["rows"] if r.get("status") == "failed"]
    print(f"[bench] wrote {out_dir}/bench.md, bench.json, bench.png" + (f"; failed: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    run_command(main)  # bad input (data, columns): one `error:` line, exit code 2
