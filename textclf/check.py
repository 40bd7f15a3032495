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
import json
import logging
import os
import sys
import warnings
from contextlib import contextmanager
from typing import Optional

from textclf.cli import parse_config, plan_run
from textclf.config import TrainConfig, require_data
from textclf.errors import InputError, run_command

PRECISIONS = ("no", "fp16", "bf16")


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

from textclf.data import sample_key
from textclf.launch import (
    BYTES_PER_PARAM,
    FRAMEWORK_BASELINE_BYTES,
    OFFLOADED_BY,
    SHARDED_FROM_STAGE,
    activation_bytes,
    check_deepspeed_config,
    cuda_only,
    deepspeed_conflicts,
    fewer_processes,
    float16_weights_conflict,
    framework_buffer_bytes,
    gpus_named,
    model_state_bytes,
    scoped,
    zero_offload,
)
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
    scratch_config,
    scratch_size,
    scratch_tokenizer_folder,
)
from textclf.tasks import Task


def read_launch(args: argparse.Namespace) -> dict:
    """What `accelerate launch [these flags] train.py` would start, resolved by accelerate's own code.

    Its launch parser and validation merge the yaml (or the default config that `accelerate config`
    wrote) with the launch line; the launcher it then picks decides how many processes start (the
    simple launcher starts one, whatever num_processes says), and its environment is what train.py's
    Accelerator and DeepSpeedPlugin read.
    """
    import yaml
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    yaml_config = None
    if path is not None:  # one that --config_file names exists (parse_args)
        try:
            yaml_config = load_config_from_file(path)
        except (yaml.YAMLError, ValueError, AttributeError) as e:  # syntax; an unknown key or value; not a mapping
            raise InputError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
        if not isinstance(getattr(yaml_config.distributed_type, "value", yaml_config.distributed_type), str):
            raise InputError(f"{path}: distributed_type is {yaml_config.distributed_type!r}; quote it "
                             "(a bare NO is YAML for false)")
        if yaml_config.mixed_precision is not None and yaml_config.mixed_precision not in PRECISIONS:
            raise InputError(f"{path}: mixed_precision is {yaml_config.mixed_precision!r}, expected one of "
                             f"{', '.join(PRECISIONS)} (quote \"no\": a bare no is YAML for false)")
    line = [f"--{name}={value}" for name in ("config_file", "num_processes", "num_machines", "mixed_precision")
            if (value := getattr(args, name)) is not None] + (["--multi_gpu"] if args.multi_gpu else [])
    launch_args = launch_command_parser().parse_args([*line, "train.py"])
    gpu_ids = gpus_named(launch_args, yaml_config)  # read from the line as given, which the merge below completes
    asked_processes = launch_args.num_processes if launch_args.num_processes is not None else \
        getattr(yaml_config, "num_processes", None)
    with quiet_accelerate():
        try:  # accelerate's private merge of yaml and line, the one its launcher reads; test_check fails if it changes
            launch_args, _, precision_from_yaml = _validate_launch_command(launch_args)
        except ValueError as e:
            raise InputError(f"accelerate launch would refuse this launch: {str(e).splitlines()[0]}") from None
        launcher, env = launcher_and_environment(launch_args, precision_from_yaml)
    cuda = has_cuda(args.target)
    if launcher == "deepspeed":
        distributed_type = "DEEPSPEED"
    elif launcher == "torchrun":  # train.py forms a gloo group on the CPU where there is no CUDA
        distributed_type = "FSDP" if env.get("ACCELERATE_USE_FSDP") == "true" else "MULTI_GPU" if cuda else "MULTI_CPU"
    else:
        distributed_type = "MULTI_CPU" if launcher == "mpirun" else "NO"
    processes = 1 if launcher == "simple" else launch_args.num_processes
    if args.mixed_precision:
        source = "the launch line (--mixed_precision)"
    elif precision_from_yaml:
        source = f"{path} mixed_precision"
    else:
        source = "the default (no mixed_precision anywhere)"
    return {"path": path, "distributed_type": distributed_type, "yaml_distributed_type": yaml_distributed_type(path),
            "launcher": launcher, "num_processes": processes, "num_machines": launch_args.num_machines or 1,
            # Without a number on the line or in a yaml, accelerate takes the number of CUDA GPUs, 0 on a CPU, and
            # its simple launcher still starts one: what was asked for is what starts.
            "requested_processes": processes if asked_processes is None else asked_processes, "gpu_ids": gpu_ids,
            "mixed_precision": env["ACCELERATE_MIXED_PRECISION"], "precision_source": source,
            "precision_from_yaml": precision_from_yaml and not args.mixed_precision, "environment": env,
            "deepspeed_config_file": getattr(launch_args, "deepspeed_config_file", None),
            "fsdp_sharding_strategy": getattr(launch_args, "fsdp_sharding_strategy", None),
            "fsdp_offload_params": str(getattr(launch_args, "fsdp_offload_params", "false")).lower() == "true",
            "fsdp_auto_wrap_policy": getattr(launch_args, "fsdp_auto_wrap_policy", None),
            "fsdp_transformer_layer_cls_to_wrap": getattr(launch_args, "fsdp_transformer_layer_cls_to_wrap", None),
            "use_cpu": bool(getattr(launch_args, "use_cpu", False)), "main_process_ip": launch_args.main_process_ip,
            "dynamo_backend": str(launch_args.dynamo_backend or "no").upper()}


def yaml_distributed_type(path: Optional[str]) -> str:
    if path is None:
        return "NO"
    from accelerate.commands.config.config_args import load_config_from_file

    kind = load_config_from_file(path).distributed_type
    return str(getattr(kind, "value", kind))


@contextmanager
def quiet_accelerate():
    """accelerate's launch helpers warn about defaults and busy ports: noise for a check that launches nothing."""
    launch_logger = logging.getLogger("accelerate.commands.launch")
    level = launch_logger.level
    launch_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        launch_logger.setLevel(level)


def launcher_and_environment(launch_args: argparse.Namespace, precision_from_yaml: bool) -> tuple[str, dict]:
    """The launcher `accelerate launch` picks (the order of launch_command's branches) and the
    ACCELERATE_* environment it gives train.py."""
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    if launch_args.use_deepspeed and not launch_args.cpu:
        fields = [*launch_args.deepspeed_config, *(["mixed_precision"] if precision_from_yaml else [])] \
            if isinstance(getattr(launch_args, "deepspeed_config", None), dict) else []
        launch_args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        launcher, env = "deepspeed", prepare_deepspeed_cmd_env(launch_args)[1]
    elif (launch_args.use_fsdp or launch_args.use_megatron_lm or launch_args.multi_gpu) and not launch_args.cpu:
        launcher, env = "torchrun", prepare_multi_gpu_env(launch_args)
    else:
        launcher = "mpirun" if getattr(launch_args, "mpirun_hostfile", None) else "simple"
        env = prepare_simple_launcher_cmd_env(launch_args)[1]
    return launcher, {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


def read_deepspeed(launch: dict, conflicts: list[str]) -> tuple[Optional[dict], str]:
    """The DeepSpeed config train.py will run with, as accelerate's DeepSpeedPlugin builds it from the
    launch's environment: the json the yaml names, or the yaml's own deepspeed_config keys with
    accelerate's defaults. None when it cannot be built (a conflict says why)."""
    from accelerate.utils import DeepSpeedPlugin

    path = launch["deepspeed_config_file"]
    place = path or f"{launch['path']} deepspeed_config"
    if path and not os.path.isfile(path):
        conflicts.append(f"{launch['path']} names deepspeed_config_file {path}, which does not exist "
                         f"(relative paths start from the directory of the launch: {os.getcwd()})")
        return None, path
    # A mixed_precision key beside the json is reported by deepspeed_precision, naming both places.
    env = dict(launch["environment"])
    env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(
        field for field in env.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",") if field != "mixed_precision")
    try:
        with patch_environment(**env):
            config = DeepSpeedPlugin().deepspeed_config
    except json.JSONDecodeError as e:
        raise InputError(f"cannot read DeepSpeed config {path}: {e}") from None
    except ValueError as e:
        conflicts.append(f"{launch['path']} with {place}: accelerate refuses it: {str(e).splitlines()[0]}")
        return None, place
    check_deepspeed_config(config, place)
    return config, place


def deepspeed_precision(launch: dict, ds: dict, ds_place: str, precision: str, source: str,
                        conflicts: list[str]) -> str:
    """The precision DeepSpeed runs: its json wins where it is explicit, and a mismatch is a conflict."""
    if launch["deepspeed_config_file"] and launch["precision_from_yaml"]:
        conflicts.append(f"{launch['path']} sets mixed_precision {launch['mixed_precision']} next to "
                         f"deepspeed_config_file {ds_place}: accelerate refuses both; remove the key and pass "
                         "--mixed_precision on the launch line (the json's \"auto\" follows it)")
    explicit = {dtype: ds.get(dtype, {}).get("enabled", "auto") for dtype in ("fp16", "bf16")}
    explicit = {dtype: value for dtype, value in explicit.items() if value != "auto"}
    enabled = [dtype for dtype, value in explicit.items() if value is True]
    for dtype, value in explicit.items():
        if (value is True) != (precision == dtype):
            conflicts.append(f"precision: {source} is {precision}, but {ds_place} sets "
                             f'"{dtype}": {{"enabled": {json.dumps(value)}}}; '
                             'set it to "auto" so that the launch decides')
    return enabled[0] if len(enabled) == 1 else precision


def check_zero(zero: dict, ds_place: str, conflicts: list[str]) -> None:
    stage = zero.get("stage", 0)
    offload = zero_offload(zero)
    if offload["param"] != "none" and stage < 3:
        conflicts.append(f"offload: {ds_place} offloads parameters to {offload['param']} at ZeRO stage {stage}; "
                         "DeepSpeed offloads parameters only at stage 3 (use stage 3, or offload_optimizer alone)")
    if offload["optimizer"] != "none" and stage < 1:
        conflicts.append(f"offload: {ds_place} offloads the optimizer to {offload['optimizer']} at ZeRO stage 0; "
                         "DeepSpeed offloads the optimizer only at stages 1 to 3")
    if stage == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        conflicts.append(f"export: {ds_place} runs ZeRO-3 without \"stage3_gather_16bit_weights_on_model_save\": "
                         "true, so the export at the end of train.py (textclf/export.py) cannot gather full "
                         "weights; set it to true")


def check_topology(launch: dict, conflicts: list[str]) -> None:
    """The yaml mistakes that make `accelerate launch` start something other than what it says."""
    path, kind = launch["path"], launch["yaml_distributed_type"]
    processes, machines = launch["num_processes"], launch["num_machines"]
    if launch["requested_processes"] < 1:
        conflicts.append(f"{path or 'the launch line'}: num_processes {launch['requested_processes']}; a launch "
                         "needs at least 1 process (num_processes counts those of all machines together)")
    shortfall = fewer_processes(processes, launch["requested_processes"], kind, path)
    if shortfall:
        conflicts.append(shortfall)
    if processes % machines:
        conflicts.append(f"{path}: num_processes {processes} (all machines together) is not a multiple of "
                         f"num_machines {machines}")
    if machines > 1 and not launch["main_process_ip"]:
        conflicts.append(f"{path}: {machines} machines but no main_process_ip for them to meet at "
                         "(set it, or pass --main_process_ip)")
    if kind == "MULTI_GPU" and launch["use_cpu"]:
        conflicts.append(f"{path}: use_cpu true with MULTI_GPU starts {processes} independent single-process runs, "
                         "not one group; set use_cpu: false (train.py uses gloo where there is no CUDA)")


def has_cuda(target: str) -> bool:
    return target == "cuda" or (target == "here" and torch.cuda.is_available())


def check_machine(launch: dict, precision: str, source: str, target: str, torch_dtype: str,
                  conflicts: list[str], warnings: list[str]) -> None:
    """What the precision and the target machine cannot run: float16 weights under fp16's loss scaler, a GPU file
    (one naming gpu_ids), fp16 and FSDP without CUDA, bf16 without native bf16."""
    if conflict := float16_weights_conflict(precision, launch["distributed_type"], torch_dtype):
        conflicts.append(conflict)
    if has_cuda(target):
        return
    machine = "this machine" if target == "here" else "the target machine (--target cpu)"
    for need, fix in cuda_only(launch["distributed_type"], precision, launch["gpu_ids"]):  # train.py refuses the same
        where = f"precision ({source})" if need.startswith("mixed_precision") else launch["path"]
        conflicts.append(f"{where}: {need}, and {machine} has no CUDA GPU: train.py refuses it there; {fix}, or "
                         "--target cuda for a GPU machine")
    if precision == "bf16" and not cpu_has_native_bf16():
        warnings.append(f"precision: {source} is bf16, but this CPU has no native bf16 (avx512_bf16 or amx_bf16 "
                        "in /proc/cpuinfo): expect bf16 to run about 10x slower than fp32 here")


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            flags = {word for line in f if line.startswith("flags") for word in line.split()}
    except OSError:  # not Linux: no way to tell, and no reason to warn
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16"})


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


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"


def human(n_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n_bytes < 1024 or unit == "GiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024


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
    sixteen_bit = kind == "DEEPSPEED" and precision != "no"  # torch autocast keeps fp32 weights and states
    loaded = cfg.torch_dtype if cfg.torch_dtype != "auto" else str(getattr(model.config, "dtype", None) or "float32")
    layout = ("16-bit" if sixteen_bit else
              "16-bit weights" if loaded.removeprefix("torch.") in ("bfloat16", "float16") else "fp32")
    memory = model_state_bytes(params, trainable, world=max(world, 1), stage=stage, layout=layout)
    sharded = [part for part in memory if stage >= SHARDED_FROM_STAGE[part]]
    offloaded = [part for part, device in offload.items() if device != "none"]
    peak = predicted_peak(cfg, model.config, memory, offloaded, kind=kind, world=max(world, 1), stage=stage, zero=zero,
                          layout=layout, precision=precision, params=params, trainable=trainable,
                          on_gpu=has_cuda(args.target))
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
        ("memory per rank", f"{human(sum(memory.values()))}: "
                            + ", ".join(f"{part} {human(n)}" + (" (CPU)" if part in offloaded else "")
                                        for part, n in memory.items())),
        ("", f"{'+'.join(map(str, BYTES_PER_PARAM[layout]))} bytes per parameter "
             f"({'the weights in ' + loaded if layout == '16-bit weights' else 'ZeRO paper'}); "
             f"sharded over {plural(world, 'rank')}: {', '.join(sharded) or 'nothing'}"),
        *peak,
    ]
    return report, warnings, conflicts


def predicted_peak(cfg: TrainConfig, config, states: dict, offloaded: list, *, kind: str, world: int, stage: int,
                   zero: dict, layout: str, precision: str, params: int, trainable: int,
                   on_gpu: bool) -> list[tuple[str, str]]:
    """The report's lines for the peak memory one rank will hold: model states, what DDP or DeepSpeed add
    (framework_buffer_bytes), activations, and on a CPU the process itself."""
    buffers = framework_buffer_bytes(
        params, trainable, world=world, stage=stage, layout=layout,
        strategy={"MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "DEEPSPEED": "deepspeed"}.get(kind, kind),
        live_parameters=zero.get("stage3_max_live_parameters", 1e9) if kind == "DEEPSPEED" else 0)
    activations = activation_bytes(
        layers=config.num_hidden_layers, hidden=config.hidden_size, heads=config.num_attention_heads,
        micro_batch=cfg.per_device_train_batch_size, sequence=cfg.max_length,
        bytes_per_value=2 if precision != "no" or layout != "fp32" else 4,
        checkpointing=cfg.gradient_checkpointing)
    # Offloaded states leave a GPU (the optimizer's fp32 buffers with its states); on a CPU they stay.
    held = sum(n for part, n in states.items() if not (on_gpu and part in offloaded))
    if on_gpu and "optimizer states" in offloaded:
        buffers = {part: n for part, n in buffers.items() if not part.startswith("fp32 ")}
    parts = {"model states": held, **buffers, "activations": activations}
    if not on_gpu:
        parts["the process"] = FRAMEWORK_BASELINE_BYTES
    where = ("of GPU memory (the CUDA context and the allocator's cache not counted)" if on_gpu else
             "of memory (resident, as measured on this CPU machine)")
    return [("peak per rank", f"{sum(parts.values()) / 2 ** 30:.2f} GiB {where}"),
            ("", " + ".join(f"{part} {human(n)}" for part, n in parts.items())
                 + f"; activations at most: {cfg.per_device_train_batch_size} x {cfg.max_length} tokens"
                 + (", checkpointed" if cfg.gradient_checkpointing else ""))]


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
