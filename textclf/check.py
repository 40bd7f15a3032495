"""The pre-launch check: what a launch would run, the memory it needs per rank, and every conflict visible now.

    python -m textclf.check --config_file accelerate_configs/zero3.yaml --per_device_train_batch_size 16
    python -m textclf.check --config_file accelerate_configs/cpu.yaml --mixed_precision bf16
    python -m textclf.check --config_file accelerate_configs/ddp_fp16.yaml --target cuda

It takes what a launch takes: the accelerate yaml and the overrides `accelerate launch` accepts for
scale and precision, then any training flag of train.py (parsed by textclf.config). It merges the
yaml, the DeepSpeed json the yaml points at and the training config, and prints the effective
strategy, processes, precision, ZeRO stage and offload, batch sizes, and the memory per rank for
weights, gradients and optimizer states. Nothing is trained and no weight is read.

Exit status: 0 when the launch is consistent (warnings allowed); 1 with one `conflict:` line per
conflict, each naming both places; 2 with one `error:` line for input it cannot read.
"""

import argparse
import glob
import os
import sys
from typing import Optional

from textclf.cli import parse_config, plan_run
from textclf.config import TrainConfig, require_data
from textclf.errors import InputError, run_command
from textclf.launch import (
    OFFLOADED_BY,
    PRECISIONS,
    check_machine,
    check_topology,
    check_zero,
    deepspeed_conflicts,
    deepspeed_precision,
    has_cuda,
    memory_report,
    plural,
    read_deepspeed,
    read_launch,
    scoped,
    zero_offload,
)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, TrainConfig]:
    parser = argparse.ArgumentParser(
        prog="python -m textclf.check", allow_abbrev=False, exit_on_error=False,
        description="Check a launch before it runs: strategy, scale, precision, batch, memory per rank, conflicts.",
        epilog="Every other flag is a training flag, as for train.py (python train.py --help).")
    parser.add_argument("--config_file", help="the accelerate yaml the launch would use; default: accelerate's "
                        "default config if `accelerate config` wrote one, else one process (python train.py)")
    parser.add_argument("--num_processes", type=int, help="processes in total, as on the launch line")
    parser.add_argument("--num_machines", type=int, help="machines, as on the launch line")
    parser.add_argument("--mixed_precision", choices=PRECISIONS, help="precision, as on the launch line")
    parser.add_argument("--multi_gpu", action="store_true", default=None,
                        help="one process per device through torchrun, as on the launch line")
    parser.add_argument("--target", choices=("here", "cpu", "cuda"), default="here",
                        help="the machine the launch is for: this one (default), one without CUDA, or one "
                        "with CUDA GPUs (to check GPU configs from a CPU machine)")
    try:
        args, training_args = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise InputError(str(e)) from None
    if args.config_file is not None and not os.path.isfile(args.config_file):
        raise InputError(f"accelerate config not found: {args.config_file}; check the path, or leave out "
                         "--config_file for accelerate's default config")
    args.training_args = training_args  # a resume parses them again, over its checkpoint's config (planned_resume)
    return args, parse_config(training_args)


if __name__ == "__main__":
    # The command line first: --help and a mistyped flag answer at once, not after the imports below.
    PARSED = run_command(lambda: parse_args(sys.argv[1:]))

import torch
from accelerate.utils import patch_environment

from textclf.models import (
    SCRATCH_VOCAB_SIZE,
    embedding_holders,
    in_units,
    layer_classes,
    load_data,
    lora_settings,
    make_model,
    model_config,
    parameter_counts,
    sample_key,
    scratch_config,
    scratch_size,
    scratch_tokenizer_folder,
)
from textclf.tasks import Task


def planned_model(cfg: TrainConfig):
    """(model, vocabulary note): the model train.py would build, on the meta device (no weight allocated
    or read), with LoRA's adapters when cfg.lora, and where its vocabulary size comes from."""
    size = scratch_size(cfg.model)
    # The task's fewest labels (the data is not read for them): the head is hidden_size x labels, a rounding
    # error next to the body.
    num_labels = Task.from_config(cfg).fewest_labels
    if size:
        learnt = learnt_vocabulary(cfg)
        config = scratch_config(size, learnt or SCRATCH_VOCAB_SIZE, cfg.max_length, num_labels=num_labels)
        vocabulary = (f"the vocabulary of {learnt:,} tokens learnt from this data (cached)" if learnt else
                      f"an upper bound: the vocabulary at its cap of {SCRATCH_VOCAB_SIZE:,} tokens, until the first "
                      "run learns one from the data (at most that large)")
    else:
        config = model_config(cfg.model, cfg.max_length, cfg.trust_remote_code)
        config.num_labels = num_labels
        vocabulary = f"its vocabulary of {config.vocab_size:,} tokens" if hasattr(config, "vocab_size") else ""
    with torch.device("meta"):
        model = make_model(config, lora=lora_settings(cfg), trust_remote_code=cfg.trust_remote_code)
    return model, vocabulary


def learnt_vocabulary(cfg: TrainConfig) -> Optional[int]:
    """The size of the vocabulary a run of a scratch model learnt from this data, if its tokenizer is in the
    cache; None before the first run (or when the data cannot be read: the launch will say why)."""
    from transformers import AutoTokenizer

    if not glob.glob(scratch_tokenizer_folder(cfg.cache_dir, "*")):
        return None  # nothing learnt here yet: no need to read the data
    try:
        train_set, _, _, data_fingerprint = load_data(cfg)
    except InputError:
        return None
    folder = scratch_tokenizer_folder(cfg.cache_dir, sample_key(data_fingerprint, len(train_set),
                                                                cfg.tokenizer_sample, cfg.seed))
    return len(AutoTokenizer.from_pretrained(folder, trust_remote_code=False)) if os.path.isdir(folder) else None


def count_parameters(cfg: TrainConfig) -> tuple[int, int]:
    """(all, trainable) parameters of the model train.py would build."""
    counts = parameter_counts(planned_model(cfg)[0])
    return counts["params"], counts["trainable"]


def check_fsdp_wrap(launch: dict, model, model_name: str, conflicts: list[str], warnings: list[str]) -> Optional[str]:
    """The layer classes FSDP will wrap one by one: those the yaml names, which the model must have, or the
    model's own (layer_classes, which make_model hands to accelerate)."""
    if (launch["fsdp_auto_wrap_policy"] or "TRANSFORMER_BASED_WRAP") != "TRANSFORMER_BASED_WRAP":
        return None
    named = launch["fsdp_transformer_layer_cls_to_wrap"]
    own = layer_classes(model)
    if not named:
        if not own:
            warnings.append(f"{launch['path']}: {model_name} declares no layer class (_no_split_modules) and "
                            "transformers marks none: FSDP would shard it as one unit; name its layer class in "
                            "fsdp_transformer_layer_cls_to_wrap")
        return f"{', '.join(own) or 'nothing'} (the model's own layer class{'es' if len(own) > 1 else ''})"
    names = [name.strip() for name in str(named).split(",")]
    present = {type(module).__name__ for module in model.modules()}
    missing = [name for name in names if name not in present]
    if missing:
        conflicts.append(f"{launch['path']} names fsdp_transformer_layer_cls_to_wrap {', '.join(missing)}, which "
                         f"{model_name} does not have (its layers: {', '.join(own) or 'none declared'}); remove the "
                         "key so that FSDP wraps the model's own layer class")
    holding_embeddings = embedding_holders(model)
    holders = [name for name in names if name in holding_embeddings]
    if holders:
        conflicts.append(f"{launch['path']} names fsdp_transformer_layer_cls_to_wrap {', '.join(holders)}, which "
                         f"holds {model_name}'s input embeddings: accelerate shards those by themselves, and FSDP2 "
                         f"cannot shard them twice; name its layers ({', '.join(own) or 'none declared'}) or remove "
                         "the key")
    return f"{', '.join(names)} (named in {launch['path']})"


def planned_metrics(cfg: TrainConfig, conflicts: list[str]) -> str:
    """The scores an evaluation of this run logs: the task's, and each --metric's module, found as train.py finds it
    (one it cannot find is a conflict)."""
    task = Task.from_config(cfg)
    found = []
    for name in dict.fromkeys(cfg.metric):
        try:
            found += [f"{name} ({metric.path})" for metric in Task.find_metrics([name])]
        except InputError as e:
            conflicts.append(str(e))
    return ", ".join([*(f"eval_{key}" for key, _, _ in task.scores), *(f"the keys of {name}" for name in found)])


def planned_resume(cfg: TrainConfig, training_args: list[str], launch: dict,
                   conflicts: list[str]) -> tuple[TrainConfig, Optional[str]]:
    """The config a resume trains with on this launch (the checkpoint's under the command line's, split to keep its
    global batch) and the report's line for it (None without a checkpoint, or with a conflict). Planned by
    train.py's own plan_run in the environment this launch gives its ranks: each refusal train.py would raise
    before torch loads is a conflict, all of them in one check."""
    refusals = []
    with patch_environment(**launch["environment"], WORLD_SIZE=launch["num_processes"]):
        cfg, start = plan_run(cfg, training_args, refusals)
    conflicts += refusals
    if start.checkpoint is None or refusals:
        return cfg, None
    path = start.checkpoint
    return cfg, f"{path}: " + (start.resplit.removeprefix(f"resuming {path}, ") if start.resplit else
                               f"the launch that made it, micro-batch {cfg.per_device_train_batch_size} and gradient "
                               f"accumulation {cfg.gradient_accumulation_steps}")


def check(args: argparse.Namespace, cfg: TrainConfig) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(report lines, warnings, conflicts) for one launch."""
    if not cfg.resume:
        require_data(cfg.data, cfg.eval_data)  # as train.py: a data file that is not there is an error, not a warning
    launch = read_launch(args)
    conflicts, warnings = [], []
    kind, world, machines = launch["distributed_type"], launch["num_processes"], launch["num_machines"]
    check_topology(launch, conflicts)
    resume_line = None
    if cfg.resume:
        cfg, resume_line = planned_resume(cfg, args.training_args, launch, conflicts)
        try:  # the data the resumed run reads (its checkpoint's), said beside the resume's other conflicts
            require_data(cfg.data, cfg.eval_data)
        except InputError as e:
            conflicts.append(str(e))
    precision, source = launch["mixed_precision"], launch["precision_source"]

    stage, offload, ds_place, zero = 0, {}, None, {}
    if kind == "DEEPSPEED":
        ds, ds_place = read_deepspeed(launch, conflicts)
        if ds is not None:
            precision = deepspeed_precision(launch, ds, ds_place, precision, source, conflicts)
            conflicts += deepspeed_conflicts(ds, ds_place, cfg, world)
            zero = ds.get("zero_optimization")
            if zero is None:
                conflicts.append(f'{ds_place} has no "zero_optimization" section, which accelerate requires')
                zero = {}
            check_zero(zero, ds_place, conflicts)
            stage = zero.get("stage", 0)
            devices = zero_offload(zero)
            offload = {part: devices[setting] for part, setting in OFFLOADED_BY.items()}
    elif kind == "FSDP":
        stage = 0 if launch["fsdp_sharding_strategy"] == "NO_SHARD" else 3
        if launch["fsdp_offload_params"]:
            offload = {"weights": "cpu", "gradients": "cpu", "optimizer states": "cpu"}
    check_machine(launch, precision, source, args.target, cfg.torch_dtype, conflicts, warnings)
    model, vocabulary = planned_model(cfg)
    fsdp_wrap = check_fsdp_wrap(launch, model, cfg.model, conflicts, warnings) if kind == "FSDP" else None

    strategy = {"NO": "one process", "MULTI_GPU": "DDP", "MULTI_CPU": "DDP", "FSDP": "FSDP, fully sharded",
                "DEEPSPEED": f"DeepSpeed ZeRO-{stage}"}.get(kind, kind)
    if world <= 1:
        devices = "a CUDA GPU" if has_cuda(args.target) else "the CPU"
    else:
        devices = "CUDA GPUs, NCCL" if has_cuda(args.target) else "the CPU, gloo (train.py's choice without CUDA)"
    accumulation, micro = cfg.gradient_accumulation_steps, cfg.per_device_train_batch_size
    counts = parameter_counts(model)
    params, trainable = counts["params"], counts["trainable"]
    offloaded = [part for part, device in offload.items() if device != "none"]
    report = [
        ("accelerate config", launch["path"] or "none: one process, as `python train.py`"),
        ("deepspeed config", ds_place or "-"),
        ("strategy", f"{strategy} ({kind}"
                     + (f"; the yaml says {launch['yaml_distributed_type']}"
                        if kind != launch["yaml_distributed_type"] else "")
                     + f") on {devices}"),
        ("processes", f"{plural(world, 'process')} on {plural(machines, 'machine')}"
                      + (f", {world // machines} per machine" if machines > 1 else "")),
        ("precision", f"{precision}, from {source}" + (f" and {ds_place}" if ds_place else "")),
        ("zero", f"stage {stage}, offload: {', '.join(f'{p} to {offload[p]}' for p in offloaded) or 'none'}"
                 if kind == "DEEPSPEED" else "-"),
        ("batch", f"micro {micro} x accumulation {accumulation} x {plural(world, 'process')} "
                  f"= global {micro * accumulation * world}"),
        *([("resume", resume_line)] if resume_line else []),
        ("model", f"{cfg.model}: {in_units(params)} parameters, {in_units(trainable)} trainable"
                  + (f" ({trainable / params:.2%}, LoRA)" if cfg.lora else "")
                  + (f"; {vocabulary}" if vocabulary else "")),
        *([("fsdp wraps", fsdp_wrap)] if fsdp_wrap else []),
        ("metrics", planned_metrics(cfg, conflicts)),
        *memory_report(cfg, model.config, params, trainable, offloaded, kind=kind, world=max(world, 1), stage=stage,
                       zero=zero, precision=precision, on_gpu=has_cuda(args.target)),
    ]
    return report, warnings, conflicts


@scoped
def main(argv: Optional[list[str]] = None, parsed: Optional[tuple] = None) -> int:
    try:
        args, cfg = parsed or parse_args(sys.argv[1:] if argv is None else argv)
        report, warnings, conflicts = check(args, cfg)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, value in report:
        print(f"{name:<18}{value}")
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    for line in conflicts:
        print(f"conflict: {line}", file=sys.stderr)
    return 1 if conflicts else 0


if __name__ == "__main__":
    sys.exit(main(parsed=PARSED))
