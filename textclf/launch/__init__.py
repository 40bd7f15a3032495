"""The launch: what `accelerate launch` or torchrun asked for, read from the environment in one place; what of it
cannot run, refused before the heavy imports; DeepSpeed's JSON and its compiled ops; the run's process (what ran, the
library settings a run changes and puts back, how a finished run ends); the memory a launch needs. Light: nothing here
imports torch at the top, so train.py and the check command refuse a launch before the heavy imports."""

from .checks import (
    check_command_line,
    check_launch_early,
    cuda_only,
    float16_weights_conflict,
    launch_shortfall,
    refuse_float16_weights,
    this_launch,
)
from .deepspeed_config import (
    before_the_accelerator,
    check_deepspeed_config,
    complete_the_plugin,
    deepspeed_conflicts,
    zero_offload,
)
from .deepspeed_ops import load_deepspeed_ops
from .environment import launch_environment
from .estimates import (
    BYTES_PER_PARAM,
    FRAMEWORK_BASELINE_BYTES,
    OFFLOADED_BY,
    SHARDED_FROM_STAGE,
    activation_bytes,
    framework_buffer_bytes,
    model_state_bytes,
    training_flops_per_token,
)
from .launch_line import fewer_processes, gpus_named
from .process import describe_run, exit_finished_run, scoped, set_for_the_run, until_the_run_ends

__all__ = [
    "BYTES_PER_PARAM", "FRAMEWORK_BASELINE_BYTES", "OFFLOADED_BY", "SHARDED_FROM_STAGE", "activation_bytes",
    "framework_buffer_bytes", "model_state_bytes", "training_flops_per_token",
    "before_the_accelerator", "check_command_line", "check_deepspeed_config",
    "check_launch_early", "complete_the_plugin", "cuda_only", "deepspeed_conflicts", "describe_run",
    "exit_finished_run", "fewer_processes", "float16_weights_conflict", "gpus_named", "launch_environment",
    "launch_shortfall", "load_deepspeed_ops", "refuse_float16_weights", "scoped",
    "set_for_the_run", "this_launch", "until_the_run_ends", "zero_offload",
]
