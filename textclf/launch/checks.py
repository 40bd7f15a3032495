"""The launch as the Accelerator will see it (processes, ZeRO stage, precision), read before the heavy imports, and
what of it cannot run: refused at once, before anything is built. The check command reads the same rules."""

import importlib
import os
from typing import Optional

from textclf.config import require_data
from textclf.errors import InputError

from .deepspeed_config import refuse_conflicts, stage_and_precision
from .launcher import launch_environment, launched_on_gpus, shortfall


def check_command_line(cfg) -> None:
    """Right after the command line is parsed: a data file that is not there, a launch that contradicts itself."""
    require_data(cfg.data, cfg.eval_data)
    this_launch(cfg.mixed_precision)


def check_launch_early(cfg) -> None:
    """Once plan_start has given `cfg` (a resumed run's batch split included): float16 weights under fp16's
    loss scaler, a DeepSpeed JSON hard-coding what the training config owns; then, with torch loaded but not yet
    transformers or the data, what this machine lacks: a CUDA GPU for a GPU file, fp16, FSDP or Liger's kernels, a
    tracker asked for."""
    launch = this_launch(cfg.mixed_precision)
    refuse_float16_weights(cfg, cfg.torch_dtype)
    if launch["zero_stage"] is not None:
        refuse_conflicts(cfg, launch["num_processes"])
    import torch

    if not torch.cuda.is_available():
        refuse_without_cuda(launch["mixed_precision"])
        if cfg.use_liger_kernel:  # Liger's kernels are Triton's: said now, not once the data is read
            raise InputError("--use_liger_kernel needs a CUDA GPU (Triton kernels), and this machine has none; leave "
                             "it out (auto turns it on where it can run)")
    if cfg.report_to != ["none"]:
        check_trackers(cfg.report_to)


def refuse_without_cuda(precision: str, launch_line: Optional[list[str]] = None) -> None:
    """On a machine without CUDA: what of this launch runs only on CUDA GPUs (cuda_only), refused before any
    process trains. `launch_line`: the `accelerate launch` line (by default the parent process's), for its GPUs."""
    by_accelerate = launch_line is not None or launch_environment().by_accelerate_launch  # else no line to read
    where, gpu_ids = (launched_on_gpus(launch_line) if by_accelerate else None) or (None, None)
    needs = cuda_only("FSDP" if launch_environment().fsdp else None, precision, gpu_ids)
    if needs:
        raise InputError("\n".join(f"{where + ': ' if gpu_ids else ''}{need}, and this machine has none: {fix}"
                                    for need, fix in needs))


# Where a launch refused for its GPUs goes instead: the zoo's files that run on a CPU.
CPU_FILES_INSTEAD = ("launch with a file of the zoo that runs on a CPU: accelerate_configs/cpu.yaml (DDP over gloo), "
                     "zero2.yaml or zero3.yaml (ZeRO; zero3 shards as FSDP does), or take gpu_ids out of a yaml of "
                     "your own")


def cuda_only(distributed_type: Optional[str], precision: str,
              gpu_ids: Optional[str] = None) -> list[tuple[str, str]]:
    """(what needs CUDA, what to do instead) for each part of a launch that runs only on CUDA GPUs, which train.py
    refuses and the check calls a conflict without CUDA: neither would fail, just silently run something else.
    `gpu_ids`: the GPUs the launch names (gpus_named), which make it a GPU file of the zoo or one like
    them: then one pair, naming all it needs, and the CPU files to launch with instead."""
    needs = []
    if precision == "fp16":
        needs.append(("mixed_precision fp16 needs a CUDA GPU (on a CPU it would silently run fp32)",
                      "launch with bf16 or no (the launch line's or the yaml's mixed_precision, or the DeepSpeed "
                      "JSON's fp16.enabled)"))
    if distributed_type == "FSDP":
        needs.append(("distributed_type FSDP needs CUDA GPUs (on a CPU accelerate would silently run plain DDP "
                      "instead)", "launch with accelerate_configs/zero3.yaml, the same sharding, which runs on a CPU"))
    if gpu_ids is not None:
        gpus = (f"gpu_ids {gpu_ids} makes it a GPU launch, which needs CUDA GPUs (on a CPU its processes would "
                "silently train there instead)")
        return [("; ".join([gpus, *(need for need, _ in needs)]), CPU_FILES_INSTEAD)]
    return needs


def refuse_float16_weights(cfg, weights_dtype: str) -> None:
    """float16_weights_conflict for this launch: `weights_dtype` is --torch_dtype, or with `auto` the checkpoint's
    (build_job, once its config is read)."""
    launch = this_launch(cfg.mixed_precision)
    sharded = "DEEPSPEED" if launch["zero_stage"] is not None else "FSDP" if launch_environment().fsdp else None
    if conflict := float16_weights_conflict(launch["mixed_precision"], sharded, weights_dtype, cfg.torch_dtype):
        raise InputError(conflict)


def float16_weights_conflict(precision: str, distributed_type: Optional[str], weights_dtype: str,
                             torch_dtype: str = "float16") -> Optional[str]:
    """float16 weights trained under torch's fp16 loss scaler, which does not unscale float16 gradients: the first
    step would fail. DeepSpeed and FSDP keep float32 copies of the weights they train. The check reports it too."""
    if precision == "fp16" and distributed_type not in ("DEEPSPEED", "FSDP") and weights_dtype == "float16":
        loaded = "" if torch_dtype == "float16" else f" (the checkpoint's, by --torch_dtype {torch_dtype})"
        return (f"float16 weights{loaded} under fp16 mixed precision: its loss scaler cannot unscale float16 "
                "gradients (the first step would fail); keep the weights in float32 (--torch_dtype float32, the "
                "default), or run bf16 on a GPU that has it")
    return None


def this_launch(mixed_precision: Optional[str]) -> dict:
    """The launch this process belongs to, as the Accelerator will see it (describe_run records that):
    processes, DeepSpeed's ZeRO stage (its JSON's, or the launch's), and the precision."""
    precision, stage = resolve_precision(mixed_precision), None
    environment = launch_environment()
    if environment.deepspeed:
        stage, precision = stage_and_precision(precision)
    return {"num_processes": environment.world_size, "zero_stage": stage,
            "mixed_precision": precision}


def resolve_precision(asked):
    """`asked` (--mixed_precision) or the launch's (ACCELERATE_MIXED_PRECISION, set by every `accelerate launch`);
    a contradiction is refused, where the Accelerator would let the script's value win without a word."""
    launched = launch_environment().mixed_precision
    if asked and launched and asked != launched:
        raise InputError(f"--mixed_precision {asked} contradicts the launch, which runs {launched} (accelerate "
                         "launch's --mixed_precision or the yaml's mixed_precision): set it on the launch line, "
                         "or drop --mixed_precision")
    return asked or launched or "no"


def launch_shortfall(started: int, launch_line: Optional[list[str]] = None) -> Optional[str]:
    """The line that says the `accelerate launch` that started this run asked for more processes than it started
    (read from its command line), or None; none is asked for without such a launch."""
    if launch_line is None and not launch_environment().by_accelerate_launch:
        return None
    return shortfall(started, launch_line)


def check_trackers(report_to: list[str]) -> None:
    """Stop now, before anything is written, if a tracker asked for is unknown or cannot start.

    Accelerate drops a tracker whose package is missing without a word (a debug log), its is_*_available
    find a package without importing it, and wandb without a login fails only in `init_trackers`, after
    run.json is written.
    """
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers  # after torch, before the data
    from accelerate.utils import LoggerType

    asked = " ".join(report_to)
    available = [str(name) for name in get_available_trackers()]  # accelerate's is_<tracker>_available
    for name in available if report_to == ["all"] else report_to:
        if name == "none":
            continue
        if name not in LOGGER_TYPE_TO_CLASS:
            raise InputError(f"--report_to {asked}: unknown tracker '{name}'; accelerate knows "
                             f"{', '.join(LOGGER_TYPE_TO_CLASS)} (or pass all or none)")
        if name not in map(str, LoggerType):
            continue  # one registered by the user's code, which imports it
        if name not in available:
            raise InputError(f"--report_to {asked}, but {name} is not installed; pip install {name}, or leave it "
                             "out of --report_to")
        try:  # what accelerate's tracker imports when it starts
            package = importlib.import_module("torch.utils.tensorboard" if name == "tensorboard" else name)
        except ImportError as e:
            raise InputError(f"--report_to {asked}, but {name} cannot be imported ({e}); pip install {name}, or "
                             "leave it out of --report_to") from None
        offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun")
        if name == "wandb" and not offline and not package.login(verify=False, prompt=False):
            raise InputError(f"--report_to {asked}, but wandb has no login here (no WANDB_API_KEY, no "
                             "`wandb login`); log in, set WANDB_MODE=offline, or leave it out of --report_to")
