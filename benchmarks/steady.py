"""The benchmark's steady-state job: how close each way of training comes to the machine's matmul rate, on texts
that fill max_length, once compiling and first allocations are behind it.

    python -m benchmarks.steady --output_dir bench_out/steady            # on a GPU: the two shapes below
    python -m benchmarks.steady --output_dir bench_out/steady --steps 60 --warmup_steps 10

Two models, random weights of public configs (nothing downloaded):
- a decoder of Qwen2.5-0.5B's shape (benchmarks/decoder.py's config), full fine-tuning, micro-batch 16 of 512 tokens;
- BERT-base (`scratch-base`), micro-batch 32 of 256 tokens.
On a machine without CUDA the same job runs at tiny shapes (a 2-layer decoder and `scratch-tiny`, a few steps): what
the tests run. Every text fills max_length (reviews of the default corpus joined until long enough), so every batch
is full and the figures measure the model, not the padding.

Rows, each a process started the way a user starts it, one process on one device, bf16 autocast on a GPU (fp32 on a
CPU): `train.py` at its defaults; `plain_pytorch`, a hand-written loop; `hf_trainer`, the Trainer with train.py's
settings; `hf_trainer_fast`, the Trainer with its own speed flags (torch_compile, and use_liger_kernel where
liger-kernel is installed). For each: ms per optimizer step, real tokens/s, model FLOP/s (textclf.launch.estimates)
as a share of the matmul rate measured in the same run (bf16's on a GPU), peak GPU memory (nvidia-smi, the allocator's
cache included) and the share of time the GPU was busy (nvidia-smi's utilization, sampled over the steady steps). The
first `--warmup_steps` steps are left out: they compile, allocate and autotune.

Writes DIR/steady.md and DIR/steady.json; each row's log.jsonl in DIR/runs/<job>/<row>/, its console output
beside it in <row>.console.log.
"""

import argparse
import csv
import json
import os
import random
import shutil
import sys
from pathlib import Path

import torch

from textclf.config import DEFAULT_DATA
from textclf.data import load_table
from textclf.errors import run_command

from .baselines import BASELINES
from .decoder import QWEN2_5_0_5B
from .measure import (
    ROW_TIMEOUT_S,
    describe_machine,
    exit_if_stopped,
    matmul_limit,
    model_flops_per_token,
    prepare_job,
    read_log,
    run_sampled,
    stop_on_signals,
)
from .plan import OFFLINE, REPO, BenchJob, command, train_args

sys.path.insert(0, str(REPO / "tests"))  # the test suite's family builders: a Qwen2-shaped model and tokenizer
from families import save_family_model  # noqa: E402

# name: (model, micro-batch, max_length) on a GPU, and at the tiny shapes of a CPU.
GPU_JOBS = {"decoder_0.5b": ("qwen2", 16, 512), "bert_base": ("scratch-base", 32, 256)}
CPU_JOBS = {"decoder_tiny": ("qwen2-tiny", 4, 32), "bert_tiny": ("scratch-tiny", 4, 32)}
TINY_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
ROWS = {  # name: (what runs, the baseline's name or None for train.py)
    "train.py": ("python train.py, its defaults", None),
    "plain_pytorch": (BASELINES["plain_pytorch"], "plain_pytorch"),
    "hf_trainer": (BASELINES["hf_trainer"], "hf_trainer"),
    "hf_trainer_fast": (BASELINES["hf_trainer_fast"], "hf_trainer_fast"),
}


def long_texts(data: str, count: int, characters: int, seed: int) -> list[dict]:
    """`count` examples whose texts are reviews joined until `characters` long, labelled by their first review."""
    rows = [row for row in load_table(data).to_list() if row.get("review")]
    generator = random.Random(seed)
    examples = []
    for _ in range(count):
        first = generator.choice(rows)
        text = first["review"]
        while len(text) < characters:
            text += " " + generator.choice(rows)["review"]
        examples.append({"label": first["label"], "review": text[:characters]})
    return examples


def build_job(name: str, model: str, batch: int, max_length: int, steps: int, warmup: int, data: str,
              folder: Path) -> tuple[BenchJob, tuple[str, str]]:
    """The job's data files (texts several times max_length long) and, for the decoder, its model folder."""
    folder.mkdir(parents=True, exist_ok=True)
    eval_rows = 2 * batch
    examples = long_texts(data, steps * batch + eval_rows, characters=4 * max_length, seed=0)
    files = []
    for split, rows in (("train", examples[eval_rows:]), ("eval", examples[:eval_rows])):
        files.append(str(folder / f"{split}.csv"))
        with open(files[-1], "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["label", "review"])
            writer.writeheader()
            writer.writerows(rows)
    if model.startswith("qwen2"):
        shape = {**QWEN2_5_0_5B, **(TINY_DECODER if model == "qwen2-tiny" else {})}
        model_folder = folder / "model"
        if not (model_folder / "config.json").exists():
            save_family_model("qwen2", [row["review"] for row in examples[:240]], model_folder, **shape)
        model = str(model_folder)
    job = BenchJob(model, steps=steps, eval_rows=eval_rows, global_batch=batch, max_length=max_length,
                   warmup_steps=warmup, suffix=f"_{name}")
    return job, (files[0], files[1])


def run_row(row: str, job: BenchJob, files: tuple[str, str], shape: dict, runs_dir: Path, cuda: bool) -> dict:
    exit_if_stopped()
    output_dir = runs_dir / row
    shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.mkdir(parents=True)
    # Beside the row's folder, not in it: train.py's --overwrite_output_dir would move it aside with the folder.
    console = runs_dir / f"{row}.console.log"
    what, baseline = ROWS[row]
    spec = {"baseline": baseline, "train_args": ["--mixed_precision", "bf16" if cuda else "no"]}
    cmd = command(spec, train_args(job, files, 1, output_dir))
    print(f"[steady] {row}{job.suffix}: {' '.join(cmd[1:])}", flush=True)
    result = {"name": row, "what": what, "command": " ".join(["python", *cmd[1:]]),
              **run_sampled(cmd, console, ROW_TIMEOUT_S)}
    try:
        result.update(read_log(output_dir / "log.jsonl", result["launched_at"], job.global_batch, job.warmup_steps))
    except (OSError, StopIteration, IndexError, KeyError, ZeroDivisionError, json.JSONDecodeError) as e:
        tail = console.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
        return {**result, "status": "failed", "reason": f"exit {result['exit_code']} ({type(e).__name__} {e}): "
                                                          + " | ".join(tail)}
    with open(output_dir / "log.jsonl", encoding="utf-8") as f:
        times = [line["time"] for line in map(json.loads, f) if "samples_per_s" in line]
    steady_from, steady_to = times[job.warmup_steps - 1], times[-1]
    busy = [value for at, value in result.pop("gpu_busy_samples") or [] if steady_from <= at <= steady_to]
    result.update(status="ok" if result["exit_code"] == 0 else "failed",
                  ms_per_step=1000 / result["steps_per_s"],
                  model_flops_per_s=model_flops_per_token(shape, False, result["tokens_per_sample"])
                  * result["real_tokens_per_s"],
                  gpu_busy=sum(busy) / len(busy) / 100 if busy else None,
                  peak_device_mb=max(result["peak_device_mb_per_rank"]) if result["peak_device_mb_per_rank"] else None)
    run_json = output_dir / "run.json"
    if run_json.is_file():  # train.py's: what it applied (compile, Liger's kernels, TF32)
        result["speed"] = json.loads(run_json.read_text(encoding="utf-8")).get("speed")
    return result


def table(rows: list[dict], limit: float, limit_name: str) -> list[str]:
    head = ["row", "what runs", "ms/step", "real tok/s", "model TFLOP/s", f"of {limit_name}", "peak GPU MB",
            "GPU busy", "eval acc"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("status") != "ok":
            out.append(f"| {r['name']} | {r['what']} | failed: {r.get('reason', '')[:300]} |" + " |" * (len(head) - 3))
            continue
        busy = "" if r["gpu_busy"] is None else f"{r['gpu_busy']:.0%}"
        out.append(f"| {r['name']} | {r['what']} | {r['ms_per_step']:.1f} | {r['real_tokens_per_s']:,.0f} | "
                   f"{r['model_flops_per_s'] / 1e12:.3f} | {r['model_flops_per_s'] / limit:.1%} | "
                   f"{r['peak_device_mb'] or ''} | {busy} | {r['eval_accuracy']:.3f} |")
    ok = {r["name"]: r for r in rows if r.get("status") == "ok"}
    if "train.py" in ok:
        out.append("")
        for other in ("plain_pytorch", "hf_trainer", "hf_trainer_fast"):
            if other in ok:
                speedup = ok[other]["ms_per_step"] / ok["train.py"]["ms_per_step"]
                out.append(f"- train.py runs at {speedup:.2f}x the speed of {other}")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.steady", description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", default="bench_out/steady", help="where steady.md, steady.json and runs/ go")
    parser.add_argument("--data", default=DEFAULT_DATA, help="reviews to make the texts of (label, review columns)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per row (default: 60 on a GPU, 4 "
                                                                "on a CPU)")
    parser.add_argument("--warmup_steps", type=int, default=None, help="first steps left out (default: 10 on a "
                                                                       "GPU, 2 on a CPU)")
    parser.add_argument("--jobs", default=None, help="comma-separated job names (default: all)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows (default: {','.join(ROWS)})")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    jobs = GPU_JOBS if cuda else CPU_JOBS
    steps = args.steps or (60 if cuda else 4)
    warmup = args.warmup_steps if args.warmup_steps is not None else (10 if cuda else 2)
    if not 1 <= warmup < steps:
        parser.error(f"--warmup_steps must be at least 1 and below --steps ({steps})")
    names = args.jobs.split(",") if args.jobs else list(jobs)
    rows = args.rows.split(",")
    if set(names) - set(jobs) or set(rows) - set(ROWS):
        parser.error(f"known jobs here: {', '.join(jobs)}; rows: {', '.join(ROWS)}")
    stop_on_signals()
    os.environ.update({k: v for k, v in OFFLINE.items() if k not in os.environ})
    out_dir = Path(args.output_dir).resolve()
    data = str(Path(args.data).resolve()) if args.data != DEFAULT_DATA else args.data
    os.chdir(REPO)
    machine = describe_machine()
    matmuls = [matmul_limit(5)]
    limit_key = "bf16_flops_per_s" if "bf16_flops_per_s" in matmuls[0] else "flops_per_s"
    report = {"machine": machine, "steps": steps, "warmup_steps": warmup, "jobs": []}
    lines = [f"# Steady state: {machine['date']}", "",
             f"{', '.join(machine['gpus']) or machine['cpu']}; torch {machine['versions']['torch']}, transformers "
             f"{machine['versions']['transformers']}, accelerate {machine['versions']['accelerate']}. Random weights, "
             f"every text filling max_length, one process, {'bf16 autocast' if cuda else 'fp32'}; {steps} optimizer "
             f"steps per row, the first {warmup} left out.", ""]
    for name in names:
        model, batch, max_length = jobs[name]
        job, files = build_job(name, model, batch, max_length, steps, warmup, data, out_dir / "jobs" / name)
        shape = prepare_job(job, *files)
        results = []
        for row in rows:
            results.append(run_row(row, job, files, shape, out_dir / "runs" / name, cuda))
            matmuls.append(matmul_limit(5))
        limit = max(m[limit_key] for m in matmuls)
        report["jobs"].append({"job": name, "model": model, "micro_batch": batch, "max_length": max_length,
                               "shape": shape, "matmul_limit_flops_per_s": limit, "rows": results})
        lines += [f"## {name}: {model}, micro-batch {batch} x {max_length} tokens, "
                  f"{shape['params'] / 1e6:.1f}M parameters", "",
                  *table(results, limit, f"{'bf16' if limit_key.startswith('bf16') else 'fp32'} matmul "
                                         f"({limit / 1e12:.3g} TFLOP/s)"), ""]
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "steady.json").write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
        (out_dir / "steady.md").write_text("\n".join(lines), encoding="utf-8")
    failed = [r["name"] for job in report["jobs"] for r in job["rows"] if r["status"] != "ok"]
    print(f"[steady] wrote {out_dir}/steady.md, steady.json" + (f"; failed: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    run_command(main)
