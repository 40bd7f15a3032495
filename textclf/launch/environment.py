"""What `accelerate launch` or torchrun told this process, read from its environment in one place.

Every other module of textclf asks launch_environment(), never os.environ, for the launch (the error path excepted: it
reads the rank and world size itself, as it must work before anything else has run). Read anew at each call, as the
check command simulates a launch by patching the environment.
"""

import os
from dataclasses import dataclass


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
