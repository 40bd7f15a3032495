"""What the launch asks for, read from what `accelerate launch` or torchrun set (the environment, the
accelerate config) before torch, accelerate or the data are loaded: a launch that cannot run is refused
at once (and what the machine lacks for it, with torch and accelerate loaded but not yet the rest).
runtime.py builds the Accelerator for it; the check (textclf/check.py) reads the same rules."""

import json
import logging
import os
import warnings
from typing import Optional

import psutil

from .config import require_data
from .errors import InputError


def this_launch(mixed_precision: Optional[str]) -> dict:
    """The launch this process belongs to, as the Accelerator will see it (runtime.describe records that):
    processes, DeepSpeed's ZeRO stage (its JSON's, or the launch's), and the precision."""
    precision, stage = resolve_precision(mixed_precision), None
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        ds_config = read_deepspeed_file(ds_file) if ds_file != "none" else {}
        stage = ds_config.get("zero_optimization", {}).get("stage", "auto")
        if stage == "auto":  # as accelerate's DeepSpeedPlugin fills it in
            stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
        # A JSON that switches a 16-bit type on itself decides the precision (accelerate's mixed_precision).
        precision = next((kind for kind in ("fp16", "bf16") if ds_config.get(kind, {}).get("enabled") is True),
                         precision)
    return {"num_processes": int(os.environ.get("WORLD_SIZE", "1")), "zero_stage": stage,
            "mixed_precision": precision}


def check_command_line(cfg) -> None:
    """Right after the command line is parsed, before anything else is read: a data file that is not there, and a
    launch that contradicts itself (a --mixed_precision other than the launch's, a DeepSpeed JSON unreadable)."""
    require_data(cfg.data, cfg.eval_data)
    this_launch(cfg.mixed_precision)


def check_launch_early(cfg) -> None:
    """Before the heavy imports and any data, once resume.plan_resume has given `cfg` (a resumed run's batch split
    included): a DeepSpeed JSON hard-coding what the training config owns. Then, with torch and accelerate loaded
    (a second) but not yet transformers or the data, what this machine lacks: a CUDA GPU for fp16 or FSDP, a
    tracker asked for."""
    launch = this_launch(cfg.mixed_precision)
    ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if launch["zero_stage"] is not None and ds_file != "none":
        conflicts = deepspeed_conflicts(read_deepspeed_file(ds_file), ds_file, cfg, launch["num_processes"])
        if conflicts:
            raise InputError(conflicts[0])
    import torch

    from .tracking import check_trackers

    if not torch.cuda.is_available():
        fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        needs = cuda_only("FSDP" if fsdp else None, launch["mixed_precision"])
        if needs:
            raise InputError("\n".join(f"{need}, and this machine has none: {fix}" for need, fix in needs))
    check_trackers(cfg.report_to)


def cuda_only(distributed_type: Optional[str], precision: str) -> list[tuple[str, str]]:
    """(what needs CUDA, what to do instead) for each part of a launch that runs only on CUDA GPUs: the one rule
    by which train.py refuses a launch on a machine without CUDA and the check calls it a conflict. Neither would
    fail there: a CPU would run fp16 as fp32, and accelerate would run FSDP as plain DDP, without a word."""
    needs = []
    if precision == "fp16":
        needs.append(("mixed_precision fp16 needs a CUDA GPU (on a CPU it would silently run fp32)",
                      "launch with bf16 or no (the launch line's or the yaml's mixed_precision, or the DeepSpeed "
                      "JSON's fp16.enabled)"))
    if distributed_type == "FSDP":
        needs.append(("distributed_type FSDP needs CUDA GPUs (on a CPU accelerate would silently run plain DDP "
                      "instead)", "launch with accelerate_configs/zero3.yaml, the same sharding, which runs on a CPU"))
    return needs


def deepspeed_conflicts(ds: dict, ds_place: str, cfg, world: int) -> list[str]:
    """What a DeepSpeed config sets that the training config owns: values not "auto" that disagree with it (accelerate
    would take DeepSpeed's accumulation with a warning, and the schedule would count another), and an optimizer
    or scheduler block."""
    conflicts = []
    micro, accumulation = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    owned = {
        "gradient_accumulation_steps": (accumulation, "--gradient_accumulation_steps"),
        "train_micro_batch_size_per_gpu": (micro, "--per_device_train_batch_size"),
        "train_batch_size": (micro * accumulation * world,
                             f"--per_device_train_batch_size x --gradient_accumulation_steps x {world} processes"),
        "gradient_clipping": (cfg.max_grad_norm, "--max_grad_norm"),
    }
    for key, (expected, flag) in owned.items():
        value = ds.get(key, "auto")
        if value != "auto" and value != expected:
            conflicts.append(f"{key}: {ds_place} hard-codes {value}, the training config has {expected} ({flag}); "
                             'set it to "auto" so that the training config decides')
    for block, made_by in (("optimizer", "AdamW"), ("scheduler", f"the {cfg.lr_scheduler_type} schedule")):
        if block in ds:
            conflicts.append(f'{ds_place} has a "{block}" block, but train.py builds {made_by} from the training '
                             "config: accelerate refuses both; remove the block")
    return conflicts


def read_deepspeed_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise InputError(f"cannot read DeepSpeed config {path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read DeepSpeed config {path}: {e}") from None
    if not isinstance(config, dict):
        raise InputError(f"DeepSpeed config {path} is not a JSON object")
    return config


def resolve_precision(asked):
    """The precision the run will use: `asked` (--mixed_precision) or the launch's; a contradiction is refused.

    `accelerate launch` always sets ACCELERATE_MIXED_PRECISION (from its --mixed_precision or the yaml),
    and the Accelerator would let the script's value win without a word.
    """
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if asked and launched and asked != launched:
        raise InputError(f"--mixed_precision {asked} contradicts the launch, which runs {launched} (accelerate "
                         "launch's --mixed_precision or the yaml's mixed_precision): set it on the launch line, "
                         "or drop --mixed_precision")
    return asked or launched or "no"


def fewer_processes(started: int, requested: int, distributed_type: str, path: Optional[str]) -> Optional[str]:
    """The line that says a launch starts fewer processes than asked for (train.py warns, the check refuses), or
    None. accelerate's simple launcher, which NO and MULTI_CPU (without mpirun) yamls get, starts one."""
    if started >= requested:
        return None
    return (f"{path or 'the launch'}: distributed_type {distributed_type} starts a single process"
            f"{' without mpirun' if distributed_type == 'MULTI_CPU' else ''}, not the {requested} asked for; for "
            "several use MULTI_GPU, as accelerate_configs/cpu.yaml does on a CPU (train.py uses gloo there), or "
            "--multi_gpu on the launch line")


def launch_shortfall(started: int, launch_line: Optional[list[str]] = None) -> Optional[str]:
    """fewer_processes for the `accelerate launch` that started this run: its line (by default the parent
    process's) read as accelerate reads it, with the yaml or the default config that `accelerate config` wrote.
    None when it asked for no more than started, or when no `accelerate launch` started this run."""
    if launch_line is None:
        if "ACCELERATE_MIXED_PRECISION" not in os.environ:  # set by every `accelerate launch`
            return None
        command = psutil.Process().parent().cmdline()
        ends = [i for i, arg in enumerate(command) if arg == "launch" or arg.endswith("accelerate.commands.launch")]
        if not ends:
            return None
        launch_line = command[ends[0] + 1:]
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    try:
        args = launch_command_parser().parse_args(launch_line)
        logger = logging.getLogger("accelerate.commands.launch")
        level = logger.level
        logger.setLevel(logging.ERROR)  # its warnings about defaults were printed by the launch itself
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # accelerate's private merge of the yaml and the launch line, what its launcher itself reads (no
                # public one); tests/test_users.py's shortfall test fails if it changes
                args = _validate_launch_command(args)[0]
        finally:
            logger.setLevel(level)
        path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
        kind = load_config_from_file(path).distributed_type if path else "NO"
    except (SystemExit, ValueError):  # a line this accelerate reads otherwise: nothing to say about it
        return None
    return fewer_processes(started, args.num_processes or 1, str(getattr(kind, "value", kind)), path)


def zero_offload(zero_optimization: dict) -> dict[str, str]:
    """Where DeepSpeed keeps optimizer states and parameters, read from the `zero_optimization` section
    of its config (run.json, the check and the benchmark all read it here): {"optimizer": "cpu", "param": "none"}."""
    return {part: zero_optimization.get(f"offload_{part}", {}).get("device", "none") for part in ("optimizer", "param")}


