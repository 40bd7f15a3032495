"""What the launch asks for, read from what `accelerate launch` or torchrun set, before the heavy imports: a launch
that cannot run is refused at once. runtime.py builds the Accelerator for it; textclf/check.py reads the same rules."""

import os
from typing import Optional

from .config import require_data
from .errors import InputError


def this_launch(mixed_precision: Optional[str]) -> dict:
    """The launch this process belongs to, as the Accelerator will see it (runtime.describe records that):
    processes, DeepSpeed's ZeRO stage (its JSON's, or the launch's), and the precision."""
    precision, stage = resolve_precision(mixed_precision), None
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        from .deepspeed_config import stage_and_precision

        stage, precision = stage_and_precision(precision)
    return {"num_processes": int(os.environ.get("WORLD_SIZE", "1")), "zero_stage": stage,
            "mixed_precision": precision}


def check_command_line(cfg) -> None:
    """Right after the command line is parsed: a data file that is not there, a launch that contradicts itself."""
    require_data(cfg.data, cfg.eval_data)
    this_launch(cfg.mixed_precision)


def check_launch_early(cfg) -> None:
    """Once resume.plan_resume has given `cfg` (a resumed run's batch split included): float16 weights under fp16's
    loss scaler, a DeepSpeed JSON hard-coding what the training config owns; then, with torch loaded but not yet
    transformers or the data, what this machine lacks: a CUDA GPU for fp16 or FSDP, a tracker asked for."""
    launch = this_launch(cfg.mixed_precision)
    refuse_float16_weights(cfg, cfg.torch_dtype)
    if launch["zero_stage"] is not None:
        from .deepspeed_config import refuse_conflicts

        refuse_conflicts(cfg, launch["num_processes"])
    import torch

    if not torch.cuda.is_available():
        needs = cuda_only("FSDP" if fsdp_launch() else None, launch["mixed_precision"])
        if needs:
            raise InputError("\n".join(f"{need}, and this machine has none: {fix}" for need, fix in needs))
    if cfg.report_to != ["none"]:
        from .trackers import check_trackers

        check_trackers(cfg.report_to)


def cuda_only(distributed_type: Optional[str], precision: str) -> list[tuple[str, str]]:
    """(what needs CUDA, what to do instead) for each part of a launch that runs only on CUDA GPUs, which train.py
    refuses and the check calls a conflict without CUDA: neither would fail, just silently run something else."""
    needs = []
    if precision == "fp16":
        needs.append(("mixed_precision fp16 needs a CUDA GPU (on a CPU it would silently run fp32)",
                      "launch with bf16 or no (the launch line's or the yaml's mixed_precision, or the DeepSpeed "
                      "JSON's fp16.enabled)"))
    if distributed_type == "FSDP":
        needs.append(("distributed_type FSDP needs CUDA GPUs (on a CPU accelerate would silently run plain DDP "
                      "instead)", "launch with accelerate_configs/zero3.yaml, the same sharding, which runs on a CPU"))
    return needs


def refuse_float16_weights(cfg, weights_dtype: str) -> None:
    """float16_weights_conflict for this launch: `weights_dtype` is --torch_dtype, or with `auto` the checkpoint's
    (job.build_job, once its config is read)."""
    launch = this_launch(cfg.mixed_precision)
    sharded = "DEEPSPEED" if launch["zero_stage"] is not None else "FSDP" if fsdp_launch() else None
    if conflict := float16_weights_conflict(launch["mixed_precision"], sharded, weights_dtype, cfg.torch_dtype):
        raise InputError(conflict)


def fsdp_launch() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


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


def resolve_precision(asked):
    """`asked` (--mixed_precision) or the launch's (ACCELERATE_MIXED_PRECISION, set by every `accelerate launch`);
    a contradiction is refused, where the Accelerator would let the script's value win without a word."""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if asked and launched and asked != launched:
        raise InputError(f"--mixed_precision {asked} contradicts the launch, which runs {launched} (accelerate "
                         "launch's --mixed_precision or the yaml's mixed_precision): set it on the launch line, "
                         "or drop --mixed_precision")
    return asked or launched or "no"


def launch_shortfall(started: int, launch_line: Optional[list[str]] = None) -> Optional[str]:
    """The line that says the `accelerate launch` that started this run asked for more processes than it started
    (textclf/launch_line.py), or None; none is asked for without such a launch."""
    if launch_line is None and "ACCELERATE_MIXED_PRECISION" not in os.environ:  # set by every `accelerate launch`
        return None
    from .launch_line import shortfall

    return shortfall(started, launch_line)


def zero_offload(zero_optimization: dict) -> dict[str, str]:
    """Where DeepSpeed keeps optimizer states and parameters, from its `zero_optimization` section (run.json, the
    check and the benchmark read it here): {"optimizer": "cpu", "param": "none"}."""
    return {part: zero_optimization.get(f"offload_{part}", {}).get("device", "none") for part in ("optimizer", "param")}
