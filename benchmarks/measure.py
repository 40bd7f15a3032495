"""Running a row and measuring it: the memory of every rank while it runs, its steady state from
log.jsonl, the matmul limit its FLOP/s are held against, and what each job is made of (its data files,
its model's shape, the padding of an epoch), prepared once before its rows."""

import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import psutil
import torch
from torch.utils.data import RandomSampler
from transformers.trainer_pt_utils import LengthGroupedSampler

from textclf.config import TrainConfig
from textclf.data import EpochLengthGroupedSampler, load_table, select_columns
from textclf.errors import InputError
from textclf.launch import OFFLOADED_BY, model_state_bytes, training_flops_per_token
from textclf.models import build_job, parameter_counts
from textclf.models.lora import apply_lora
from textclf.tasks import Task

from .plan import OFFLINE, REPO, BenchJob, command, train_args

ROW_TIMEOUT_S = 900
SAMPLE_EVERY_S = 0.2


# --- running one row: wall time, the memory of each rank, its figures from log.jsonl ----------------------

stop_signals = []  # SIGTERM or SIGINT received: the benchmark stops the running row and ends


def stop_on_signals() -> None:
    """SIGTERM (a scheduler, `timeout`) and SIGINT (Ctrl-C) unwind the benchmark, so that the running row is stopped
    too (run_sampled's `finally`). The exit the handler raises is lost where the signal lands inside a finalizer
    (Python ignores exceptions there), so each row and each sample also looks at what was received (exit_if_stopped)."""
    def stop(signum, _frame):
        stop_signals.append(signum)
        sys.exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)


def exit_if_stopped() -> None:
    if stop_signals:
        sys.exit(128 + stop_signals[0])


def run_sampled(cmd: list[str], console: Path, timeout_s: float) -> dict:
    """Run `cmd`, sampling the resident memory of every rank (and its GPU memory) until it exits.

    A rank is a process that has RANK in its environment while its parent has not (the launcher);
    without a launcher the process itself is the only rank. Compilers that DeepSpeed starts inherit
    RANK from their rank and are not counted.
    """
    env = {**OFFLINE, **os.environ}
    peak_rss, peak_gpu, rank_of, busy = {}, {}, {}, []
    launched_at = time.time()
    with open(console, "w", encoding="utf-8") as out:
        # A session of its own: a Ctrl-C in the terminal reaches the benchmark alone, which stops the row.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        root = psutil.Process(proc.pid)
        try:
            while proc.poll() is None and time.time() - launched_at < timeout_s:
                exit_if_stopped()
                gpu_memory = gpu_memory_by_pid() if torch.cuda.is_available() else {}
                if torch.cuda.is_available():
                    busy.append((time.time(), gpu_utilization()))
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
                        parent = safe(p.parent) if safe(p.ppid) in pids else None  # None once the parent ended
                        parent_env = safe(parent.environ) if parent is not None else None
                        if rank is not None and parent_env is not None and "RANK" not in parent_env:
                            rank_of[p.pid] = int(rank)
                time.sleep(SAMPLE_EVERY_S)
        finally:  # past the time limit, or the benchmark itself stopped (SIGTERM, Ctrl-C)
            timed_out = proc.poll() is None
            if timed_out:
                stop_tree(root)
                proc.wait()
    ranks = sorted(rank_of, key=rank_of.get) or [proc.pid]
    mb = 2 ** 20
    return {"launched_at": launched_at, "wall_s": time.time() - launched_at, "exit_code": proc.returncode,
            "timed_out": timed_out,
            "peak_rss_mb_per_rank": [round(peak_rss.get(pid, 0) / mb) for pid in ranks],
            "peak_device_mb_per_rank": [round(peak_gpu.get(pid, 0) / mb) for pid in ranks]
            if torch.cuda.is_available() else None,
            "gpu_busy_samples": [(at, value) for at, value in busy if value is not None] or None}


def stop_tree(root: psutil.Process, grace_s: float = 0) -> None:
    """Kill a launch: its launcher and every process under it. Not the launcher's process group alone:
    torchrun starts each rank in a session of its own, and a rank still importing has not yet tied its
    life to the launcher's (errors.die_with_launcher). With `grace_s`, SIGTERM first, for that long."""
    tree = [root, *safe(root.children, recursive=True, default=[])]
    if grace_s:
        for process in tree:
            safe(process.terminate)
        _, tree = psutil.wait_procs(tree, timeout=grace_s)
    for process in tree:
        safe(process.kill)


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


def gpu_utilization() -> Optional[int]:
    """The share of the last sample period (1/6 s to 1 s) in which a kernel ran on GPU 0, in percent (nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return int(out) if out.isdigit() else None


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


def run_row(row: dict, job: BenchJob, files: tuple[str, str], shape: dict, runs_dir: Path) -> dict:
    """Run one row and turn its measurements into the row's figures."""
    exit_if_stopped()
    output_dir = runs_dir / row["name"]
    shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.mkdir(parents=True)
    # Beside the row's folder, not in it: train.py's --overwrite_output_dir would move it aside with the folder.
    console = runs_dir / f"{row['name']}.console.log"
    cmd = command(row, train_args(job, files, row["processes"], output_dir))
    print(f"[bench] {row['name']}: {' '.join(cmd[1:])}", flush=True)
    result = {**row, "model": job.model, "command": " ".join(["python", *cmd[1:]]),
              **run_sampled(cmd, console, ROW_TIMEOUT_S)}
    result.pop("gpu_busy_samples")  # the steady-state job reads them (benchmarks/steady.py)
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
        tail = console.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
        result.update(status="failed", reason=f"exit {result['exit_code']}, no complete log ({type(e).__name__} {e}): "
                                              + " | ".join(tail))
        return result
    result["status"] = "ok"
    if result["exit_code"] != 0:  # DeepSpeed sometimes aborts after the script finished (NOTES.md)
        result["reason"] = f"exit code {result['exit_code']} after the run"
    result["model_flops_per_s"] = model_flops_per_token(shape, lora, result["tokens_per_sample"]) \
        * result["real_tokens_per_s"]
    return result


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


# --- model FLOPs and memory by the theory (textclf.launch.estimates), and the matmul limit ---------------

def model_flops_per_token(shape: dict, lora: bool, tokens_per_sample: float) -> float:
    """Training FLOPs per real token of the job's model (textclf.launch.estimates); LoRA trains the adapters and head
    only."""
    trainable = shape["lora_trainable"] if lora else shape["non_embedding_params"]
    return training_flops_per_token(shape["non_embedding_params"], trainable, shape["layers"], shape["hidden"],
                                    tokens_per_sample)


def device_state_bytes(params: int, trainable: int, processes: int, zero_stage: Optional[int], offload: list,
                       mixed: bool, on_gpu: bool) -> float:
    """The model states one rank holds in its device's memory (textclf.launch.estimates): offloaded parts leave
    a GPU but stay in the host's memory, so on a CPU they still count."""
    parts = model_state_bytes(params, trainable, world=processes, stage=zero_stage or 0, sixteen_bit=mixed)
    return sum(n for part, n in parts.items() if not (on_gpu and OFFLOADED_BY.get(part) in offload))


def matmul_limit(repeats: int) -> dict:
    """FLOP/s torch reaches on a large matmul here, the ceiling for model FLOP/s (median of repeats): in
    fp32, and on a GPU with bf16 also in bf16, the ceiling of the 16-bit rows."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = 8192 if device == "cuda" else 2048

    def rate(dtype) -> float:
        a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
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
        return 2 * size ** 3 / statistics.median(seconds)

    limit = {"size": size, "repeats": repeats, "threads": torch.get_num_threads(), "device": device,
             "flops_per_s": rate(torch.float32)}
    if device == "cuda" and torch.cuda.is_bf16_supported():
        limit["bf16_flops_per_s"] = rate(torch.bfloat16)
    return limit


def limit_of(row: dict, matmul: dict) -> float:
    """The matmul rate a row is held against: bf16's for a 16-bit row where it was measured (a GPU), else
    fp32's (a CPU's bf16 rows too: without native bf16 its matmuls are no faster)."""
    if row.get("precision", "no") in ("bf16", "fp16") and "bf16_flops_per_s" in matmul:
        return matmul["bf16_flops_per_s"]
    return matmul["flops_per_s"]


# --- data, model and DeepSpeed's ops, prepared once per job -----------------------------------------------

def job_data(job: BenchJob, data: str, folder: str) -> tuple[str, str]:
    """The job's training and evaluation files: disjoint seeded samples of `data`, written as CSV.

    The training file holds exactly job.train_examples examples.
    """
    defaults = TrainConfig()
    table = select_columns(load_table(data), data, Task.from_config(defaults)).remove_columns(["row"])
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


def prepare_job(job: BenchJob, train_file: str, eval_file: str) -> dict:
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
    build = subprocess.Popen([sys.executable, "scripts/warm_deepspeed_ops.py"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = build.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        return "timed out after 900 s (the rows build what they need)"
    finally:  # timed out, or the benchmark itself stopped: a SIGTERM lets torch remove its build lock
        if build.poll() is None:
            stop_tree(psutil.Process(build.pid), grace_s=10)
    if build.returncode:
        return f"failed ({(stderr.strip().splitlines() or [str(build.returncode)])[-1]})"
    return f"{time.time() - start:.0f} s"


# --- the machine ------------------------------------------------------------------------------------------

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
