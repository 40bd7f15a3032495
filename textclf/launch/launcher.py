"""What the launcher (`accelerate launch` or torchrun) told this process: its environment, read in one place, and the
`accelerate launch` line that started it, read as accelerate reads it (how many processes it asked for, and whether it
names GPUs).

Every other module of textclf asks launch_environment(), never os.environ, for the launch (the error path excepted: it
reads the rank and world size itself, as it must work before anything else has run). Read anew at each call, as the
check command simulates a launch by patching the environment.
"""

import argparse
import logging
import os
import warnings
from dataclasses import dataclass
from typing import NamedTuple, Optional

import psutil


@dataclass(frozen=True)
class LaunchEnvironment:
    """The launch this process belongs to, as its launcher set it up."""

    world_size: int = 1
    """WORLD_SIZE: processes in the launch, on every machine."""
    rank: int = 0
    """RANK: this process's place among them."""
    local_rank: int = 0
    """LOCAL_RANK: its place among the processes of its machine."""
    num_machines: int = 1
    """ACCELERATE_NUM_MACHINES, or torchrun's GROUP_WORLD_SIZE."""
    deepspeed: bool = False
    """ACCELERATE_USE_DEEPSPEED: a DeepSpeed launch."""
    fsdp: bool = False
    """ACCELERATE_USE_FSDP: an FSDP launch."""
    deepspeed_config_file: str = "none"
    """ACCELERATE_DEEPSPEED_CONFIG_FILE: the DeepSpeed JSON its yaml names ("none": none)."""
    deepspeed_zero_stage: int = 2
    """ACCELERATE_DEEPSPEED_ZERO_STAGE: the yaml's stage, where the JSON says "auto"."""
    mixed_precision: str | None = None
    """ACCELERATE_MIXED_PRECISION: set by every `accelerate launch` (None: no such launch)."""

    @property
    def by_accelerate_launch(self) -> bool:
        return self.mixed_precision is not None


def launch_environment() -> LaunchEnvironment:
    env = os.environ

    def flag(name: str) -> bool:
        return env.get(name, "false").lower() == "true"

    return LaunchEnvironment(
        world_size=int(env.get("WORLD_SIZE", "1")), rank=int(env.get("RANK", "0")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        num_machines=int(env.get("ACCELERATE_NUM_MACHINES", env.get("GROUP_WORLD_SIZE", 1))),
        deepspeed=flag("ACCELERATE_USE_DEEPSPEED"), fsdp=flag("ACCELERATE_USE_FSDP"),
        deepspeed_config_file=env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none"),
        deepspeed_zero_stage=int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")),
        mixed_precision=env.get("ACCELERATE_MIXED_PRECISION"))


def fewer_processes(started: int, requested: int, distributed_type: str, path: Optional[str]) -> Optional[str]:
    """The line that says a launch starts fewer processes than asked for (train.py warns, the check refuses), or
    None. accelerate's simple launcher, which NO and MULTI_CPU (without mpirun) yamls get, starts one."""
    if started >= requested:
        return None
    return (f"{path or 'the launch'}: distributed_type {distributed_type} starts a single process"
            f"{' without mpirun' if distributed_type == 'MULTI_CPU' else ''}, not the {requested} asked for; for "
            "several use MULTI_GPU, as accelerate_configs/cpu.yaml does on a CPU (train.py uses gloo there), or "
            "--multi_gpu on the launch line")


def gpus_named(line: argparse.Namespace, config) -> Optional[str]:
    """The GPUs a launch names, which make it a GPU launch (train.py refuses it without CUDA, the check calls it a
    conflict), or None. `line`: the launch line as given (not yet completed from the yaml); `config`: its yaml, read.

    A GPU launch is one that names GPUs: --gpu_ids, or the yaml's gpu_ids. Every GPU file of the zoo names them
    (all, or "0"), as `accelerate config` writes gpu_ids only for a launch not on the CPU (use_cpu false); cpu.yaml,
    the ZeRO files and multi_node.yaml name none. The environment `accelerate launch` gives the ranks cannot tell:
    gpu_ids all sets no variable, and ddp.yaml starts MULTI_GPU through torchrun with use_cpu false exactly as
    cpu.yaml does, which runs on a CPU on purpose (train.py forms a gloo group there); the number of processes and
    bf16 are the launch line's to choose for either (cpu.yaml --num_processes 8 --mixed_precision bf16 gives
    ddp_bf16.yaml's environment). A launch that asks for the CPU itself (--cpu, use_cpu: true) runs there whatever
    GPUs it names."""
    if getattr(line, "cpu", False) or getattr(config, "use_cpu", False):
        return None
    named = line.gpu_ids if getattr(line, "gpu_ids", None) is not None else getattr(config, "gpu_ids", None)
    return None if named is None else str(named)


def parent_launch_line() -> Optional[list[str]]:
    """The arguments of the `accelerate launch` that started this process (its parent, which torchrun's agent and
    the simple launcher run in), or None when no `accelerate launch` did."""
    try:
        parent = psutil.Process().parent()
        command = parent.cmdline() if parent is not None else []
    except psutil.Error:
        return None
    ends = [i for i, arg in enumerate(command) if arg == "launch" or arg.endswith("accelerate.commands.launch")]
    return command[ends[0] + 1:] if ends else None


class LaunchLine(NamedTuple):
    """An `accelerate launch` line, read as accelerate's launcher reads it."""

    given: argparse.Namespace
    """As typed."""
    completed: argparse.Namespace
    """Completed from the yaml, as the launcher runs it."""
    path: Optional[str]
    """The yaml: --config_file, or the default config that `accelerate config` wrote (None: neither)."""
    config: object
    """The yaml, read (None without one)."""


def read_launch_line(launch_line: Optional[list[str]] = None) -> Optional[LaunchLine]:
    """`launch_line` (by default the parent process's) as accelerate reads it; None when no `accelerate launch`
    started this process."""
    launch_line = parent_launch_line() if launch_line is None else launch_line
    if launch_line is None:
        return None
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    try:
        given = launch_command_parser().parse_args(launch_line)
        completed = argparse.Namespace(**vars(given))
        logger = logging.getLogger("accelerate.commands.launch")
        level = logger.level
        logger.setLevel(logging.ERROR)  # its warnings about defaults were printed by the launch itself
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # accelerate's private merge of the yaml and the launch line, what its launcher itself reads (no
                # public one); tests/launch/test_checks.py's shortfall test fails if it changes
                completed = _validate_launch_command(completed)[0]
        finally:
            logger.setLevel(level)
        path = completed.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
        return LaunchLine(given, completed, path, load_config_from_file(path) if path else None)
    except (SystemExit, ValueError):  # a line this accelerate reads otherwise: nothing to say about it
        return None


def shortfall(started: int, launch_line: Optional[list[str]] = None) -> Optional[str]:
    """fewer_processes for the `accelerate launch` that started this run (launch.launch_shortfall): its line (by
    default the parent process's) read as accelerate reads it, with the yaml or the default config that `accelerate
    config` wrote. None when it asked for no more than started, or when no `accelerate launch` started this run."""
    read = read_launch_line(launch_line)
    if read is None:
        return None
    kind = read.config.distributed_type if read.config is not None else "NO"
    return fewer_processes(started, read.completed.num_processes or 1, str(getattr(kind, "value", kind)), read.path)


def launched_on_gpus(launch_line: Optional[list[str]] = None) -> Optional[tuple[str, str]]:
    """(where, gpu ids): the GPUs the `accelerate launch` that started this run names (gpus_named), and where it
    names them (its yaml, or the launch line); None when it names none, or no `accelerate launch` started it."""
    read = read_launch_line(launch_line)
    if read is None:
        return None
    named = gpus_named(read.given, read.config)
    if named is None:
        return None
    return ("the launch line (--gpu_ids)" if read.given.gpu_ids is not None else read.path), named
