"""The benchmark's decoder job: peak memory per rank of a 0.5B decoder classifier under DDP, ZeRO-2,
ZeRO-3 and ZeRO-3 offload, beside the ZeRO-paper theory and what `python -m textclf.check` predicts for
the same launch. Weights this size make the sharding show, which the default job's cannot.

    python -m benchmarks.decoder --output_dir bench_out/decoder             # every launch
    python -m benchmarks.decoder --output_dir bench_out/decoder zero3.yaml  # some of them
    python -m benchmarks.decoder --output_dir bench_out/decoder_8 --layers 8   # 255M, where 0.5B won't fit

The model is built from the public Qwen2.5-0.5B config values (hidden 896, 24 layers, 14 heads, 2
key-value heads, intermediate 4864, vocabulary 151,936: 494M parameters with its classification head)
with random weights, and saved with a Qwen2-shaped byte-level tokenizer (no pad token) learnt from 240
reviews of the default corpus, which are also the data. Each launch is 2 processes, `accelerate launch
--config_file accelerate_configs/<file> train.py`, 2 optimizer steps of micro-batch 2 at --max_length 64,
fp32, then the evaluation and the export that end every run. Peak memory per rank is the kernel's
high-water mark of its resident memory (VmHWM in /proc/<pid>/status), read until the rank exits; the
resident memory is also sampled every 0.5 s, to tell the training steps from the export at the end.
A launch is stopped if the machine's available memory falls under 0.5 GiB (there is no swap here),
and its ranks are the first the kernel ends should memory run out.
Writes <output_dir>/results.json and prints a table (docs/models.md holds the one measured here).
"""

import argparse
import csv
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

from textclf.config import DEFAULT_DATA

from .measure import exit_if_stopped, stop_on_signals, stop_tree
from .plan import OFFLINE, REPO, free_port

sys.path.insert(0, str(REPO / "tests"))  # the test suite's family builders: a Qwen2-shaped model and tokenizer
from families import save_family_model  # noqa: E402

LAUNCHES = ["cpu.yaml", "zero2.yaml", "zero3.yaml", "zero3_offload.yaml"]
# Qwen2.5-0.5B's config.json on the hub, the values that size the model.
QWEN2_5_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                    rms_norm_eps=1e-6, tie_word_embeddings=True)
TRAINING = ["--max_length", "64", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "8",
            "--max_steps", "2", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none"]
STOP_BELOW = 2 ** 29  # bytes of available memory


def build(output_dir: Path, layers: int, reviews: str) -> tuple[Path, Path]:
    """The data (240 of `reviews`, 120 per label, cut to 60 characters) and the model folder."""
    from textclf.data import load_table

    data = output_dir / "reviews.csv"
    model = output_dir / f"qwen2-{layers}-layers"
    if not data.exists():
        rows = load_table(reviews).to_list()  # the default corpus is built at first use
        random.Random(0).shuffle(rows)
        picked = [r for label in ("negative", "positive") for r in [r for r in rows if r["label"] == label][:120]]
        with open(data, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["label", "review"])
            writer.writeheader()
            writer.writerows({"label": r["label"], "review": r["review"][:60]} for r in picked)
    if not (model / "model.safetensors").exists():
        with open(data, encoding="utf-8", newline="") as f:
            texts = [row["review"] for row in csv.DictReader(f)]
        save_family_model("qwen2", texts, model, **{**QWEN2_5_0_5B, "num_hidden_layers": layers})
    return data, model


def hwm(pid: int) -> tuple[int, int]:
    """(VmHWM, VmRSS) of a process in bytes."""
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return tuple(int(fields[key].split()[0]) * 1024 for key in ("VmHWM", "VmRSS"))


def measure(yaml_name: str, data: Path, model: Path, output_dir: Path) -> dict:
    out = output_dir / yaml_name.removesuffix(".yaml")
    args = ["--model", str(model), "--data", str(data), "--cache_dir", str(output_dir / "cache"),
            "--output_dir", str(out), "--overwrite_output_dir", *TRAINING]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{yaml_name}",
           "--main_process_port", str(free_port()), "train.py", *args]
    ranks, timeline, stopped = {}, [], None
    started = time.time()
    with open(output_dir / f"{yaml_name}.log", "w", encoding="utf-8") as console:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **OFFLINE}, stdout=console,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                exit_if_stopped()
                for child in psutil.Process(proc.pid).children(recursive=True):
                    try:
                        parent = child.parent()
                        if parent is None:  # it ended between the two calls
                            continue
                        environ, parent_environ = child.environ(), parent.environ()
                        if child.pid not in ranks and "RANK" in environ and "RANK" not in parent_environ:
                            ranks[child.pid] = int(environ["RANK"])
                            # Should memory run out after all, the kernel ends a rank, not someone else's process.
                            with open(f"/proc/{child.pid}/oom_score_adj", "w", encoding="utf-8") as f:
                                f.write("1000")
                    except (psutil.Error, OSError):
                        continue
                sample = {"t": round(time.time() - started, 1)}
                for pid, rank in ranks.items():
                    try:
                        peak, rss = hwm(pid)
                    except (OSError, KeyError):
                        continue
                    sample[f"rss{rank}"], sample[f"hwm{rank}"] = rss, peak
                timeline.append(sample)
                if psutil.virtual_memory().available < STOP_BELOW:
                    stopped = f"stopped at {sample['t']} s: available memory under {STOP_BELOW / 2 ** 30:.1f} GiB"
                    stop_tree(psutil.Process(proc.pid))
                    proc.wait()
                    break
                time.sleep(0.5)
        finally:  # the benchmark itself stopped (SIGTERM, Ctrl-C): its launch stops with it
            if proc.poll() is None:
                stop_tree(psutil.Process(proc.pid))
                proc.wait()
    steps = []
    if (out / "log.jsonl").exists():
        steps = [json.loads(line) for line in open(out / "log.jsonl", encoding="utf-8")]
    last_step = max((row["time"] - started for row in steps if "loss" in row), default=None)
    gib = 2 ** 30
    per_rank = [max((s.get(f"hwm{r}", 0) for s in timeline), default=0) / gib for r in sorted(set(ranks.values()))]
    training = [max((s.get(f"rss{r}", 0) for s in timeline if last_step is None or s["t"] <= last_step + 0.5),
                    default=0) / gib for r in sorted(set(ranks.values()))]
    return {"launch": yaml_name, "exit_code": proc.returncode, "stopped": stopped,
            "wall_s": round(time.time() - started),
            "peak_gib_per_rank": [round(x, 2) for x in per_rank],
            "peak_gib_per_rank_until_last_step": [round(x, 2) for x in training],
            "args": args, "losses": [row.get("loss") for row in steps if "loss" in row], "timeline": timeline}


def predict(yaml_name: str, args: list[str]) -> str:
    """What `python -m textclf.check` says about the launch."""
    return subprocess.run([sys.executable, "-m", "textclf.check", "--config_file", f"accelerate_configs/{yaml_name}",
                           "--target", "cpu", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **OFFLINE}).stdout


def main() -> None:
    stop_on_signals()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=24,
                        help="decoder layers: 24 is Qwen2.5-0.5B (494M parameters); 8 gives 255M, for a machine of "
                        "24 GB that other work shares (DDP of the 0.5B peaks at about 2 x 11.3 GB with its export)")
    parser.add_argument("--data", default=DEFAULT_DATA, help="reviews to take the texts from (label, review columns)")
    parser.add_argument("launches", nargs="*", default=LAUNCHES, help="zoo files to launch (default: all four)")
    args = parser.parse_args()
    args.output_dir = args.output_dir.resolve()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    reviews = str(Path(args.data).resolve()) if args.data != DEFAULT_DATA else args.data
    os.chdir(REPO)  # where the launches run, and where the default corpus is built
    data, model = build(args.output_dir, args.layers, reviews)
    results_path = args.output_dir / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for name in args.launches:
        print(f"[decoder] {name} ...", flush=True)
        results[name] = measure(name, data, model, args.output_dir)
        results_path.write_text(json.dumps(results, indent=1))
    for name, result in results.items():  # the check of each launch, with the check as it is now
        result["check"] = predict(name, result["args"])
        result["theory_gib"] = check_figure("memory per rank", result["check"])
        result["predicted_gib"] = check_figure("peak per rank", result["check"])
    results_path.write_text(json.dumps(results, indent=1))
    print(f"{'launch':<20}{'exit':>5}{'peak GiB/rank':>18}{'until last step':>18}{'theory (states)':>17}"
          f"{'check predicts':>16}")
    for name, r in results.items():
        print(f"{name:<20}{r['exit_code']!s:>5}{' / '.join(map(str, r['peak_gib_per_rank'])):>18}"
              f"{' / '.join(map(str, r['peak_gib_per_rank_until_last_step'])):>18}{r['theory_gib']!s:>17}"
              f"{r['predicted_gib']!s:>16}" + (f"  {r['stopped']}" if r["stopped"] else ""))


def check_figure(label: str, check_output: str):
    """A figure of the check's output in GiB: the model states per rank by the ZeRO paper ("memory per
    rank") or its predicted peak ("peak per rank")."""
    found = re.search(rf"^{label}\s+([\d.]+) (MiB|GiB)", check_output, re.M)
    if not found:
        return None
    return round(float(found.group(1)) / (1024 if found.group(2) == "MiB" else 1), 2)


if __name__ == "__main__":
    main()
