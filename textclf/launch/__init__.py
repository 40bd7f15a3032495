"""The launch: what `accelerate launch` or torchrun asked for, read from the environment in one place; what of it
cannot run, refused before the heavy imports; DeepSpeed's JSON and its compiled ops; the run's process (what ran, the
library settings a run changes and puts back, how a finished run ends); the memory a launch needs. Light: nothing here
imports torch at the top, so train.py and the check command refuse a launch before the heavy imports."""

from .checks import check_command_line, check_launch_early, launch_shortfall, refuse_float16_weights, this_launch
from .conflicts import check_machine, check_topology, check_zero, deepspeed_precision
from .deepspeed_config import before_the_accelerator, complete_the_plugin, deepspeed_conflicts, zero_offload
from .deepspeed_ops import load_deepspeed_ops
from .estimates import OFFLOADED_BY, model_state_bytes, training_flops_per_token
from .launcher import launch_environment
from .memory_report import memory_report, plural
from .process import describe_run, exit_finished_run, scoped, set_for_the_run, until_the_run_ends
from .resolved import PRECISIONS, has_cuda, read_deepspeed, read_launch

__all__ = [
    "OFFLOADED_BY", "PRECISIONS", "before_the_accelerator", "check_command_line", "check_launch_early", "check_machine",
    "check_topology", "check_zero", "complete_the_plugin", "deepspeed_conflicts", "deepspeed_precision", "describe_run",
    "exit_finished_run", "has_cuda", "launch_environment", "launch_shortfall", "load_deepspeed_ops", "memory_report",
    "model_state_bytes", "plural", "read_deepspeed", "read_launch", "refuse_float16_weights", "scoped",
    "set_for_the_run", "this_launch", "training_flops_per_token", "until_the_run_ends", "zero_offload",
]
