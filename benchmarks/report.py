"""The benchmark's report: bench.md (the machine, the padding of an epoch, one table of rows per job,
train.py against the plain loop and the Trainer, ZeRO's memory against the theory, how to read it),
bench.json (one object per row) and bench.png (throughput and memory per strategy)."""

import json
import statistics
from pathlib import Path

import torch

from .measure import PADDING_ORDERS, SAMPLE_EVERY_S, limit_of


def peak_mb(row: dict) -> int:
    """The memory that limits a run: the GPU's where there is one, else the host's."""
    return row.get("peak_device_mb", row["peak_rss_mb"])


def fmt(value, digits=1) -> str:
    if value is None:
        return ""
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def measured(speeds: list) -> list[float]:
    return [speed for speed in speeds if speed is not None]


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


def bf16_limits(matmuls: list[dict]) -> str:
    """The bf16 matmul limit, where it was measured (a GPU with bf16): the 16-bit rows are held against it."""
    limits = sorted(m["bf16_flops_per_s"] / 1e9 for m in matmuls if "bf16_flops_per_s" in m)
    if not limits:
        return ""
    return (f"; in bf16 {limits[0]:.1f} to {limits[-1]:.1f} GFLOP/s, median {statistics.median(limits):.1f}, "
            "the limit of the bf16 and fp16 rows")


def write_report(out_dir: Path, machine: dict, matmuls: list[dict], padding: dict, sections: list[dict],
                 argv: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [r for section in sections for r in section["rows"]]
    for r in (r for r in rows if r.get("status") == "ok"):
        # The CPU's limit is measured on all its cores, which every row uses; a GPU's is per GPU.
        devices = r["processes"] if r["matmul_limit"]["device"] == "cuda" else 1
        r["matmul_limit_flops_per_s"] = limit_of(r, r["matmul_limit"]) * devices
        r["limit_fraction"] = r["model_flops_per_s"] / r["matmul_limit_flops_per_s"]
    matmul, limits = matmuls[0], sorted(m["flops_per_s"] / 1e9 for m in matmuls)
    with open(out_dir / "bench.json", "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    v = machine["versions"]
    lines = [f"# Benchmark: `python -m benchmarks {' '.join(argv)}`".rstrip(), "",
             f"{machine['date']}; {machine['cpu']}, {machine['physical_cores']} cores ({machine['logical_cores']} "
             f"logical), {machine['memory_gb']} GB" + (f"; GPUs: {', '.join(machine['gpus'])}" if machine["gpus"] else
                                                        "; no GPU") + f"; {machine['os']}.",
             "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + ".",
             f"Matmul limit: {limits[0]:.1f} to {limits[-1]:.1f} GFLOP/s, median {statistics.median(limits):.1f} "
             f"(fp32 {matmul['size']}x{matmul['size']} on {matmul['device']}, {matmul['threads']} threads, median of "
             f"{matmul['repeats']} products; measured {len(matmuls)} times, before the first row and after each)"
             + bf16_limits(matmuls) + ". Each row's fraction is against the higher of the measurements just before and "
             "after it.", "",
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
