"""The Accelerator for the hardware at hand, and the facts about a run worth recording."""

import contextlib
import io
import logging
import math
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import DistributedType, DynamoBackend

from . import tracking
from .config import TrainConfig
from .errors import InputError, exit_now, verbose
from .launch import zero_offload
from .quiet import set_for_the_run


def make_accelerator(cfg: TrainConfig, load_universal: bool = False) -> Accelerator:
    """One Accelerator for every zoo file, on GPUs and CPUs alike. `load_universal`: ZeRO's states come from
    DeepSpeed's universal checkpoint (a resume on another number of processes). Without CUDA, DDP needs `cpu=True`
    to form a gloo group (else each rank runs alone), DeepSpeed `cpu=False` and gloo (`cpu=True` would run DDP)."""
    has_cuda = torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if deepspeed:
        from .deepspeed_config import before_the_accelerator

        before_the_accelerator(has_cuda)
    with contextlib.redirect_stdout(io.StringIO()) as said:  # DeepSpeed prints "... built successfully" per rank
        accelerator = Accelerator(
            cpu=not has_cuda and not deepspeed,
            mixed_precision=cfg.mixed_precision,  # None: the launch's (ACCELERATE_MIXED_PRECISION), or "no"
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            # The schedule is defined in optimizer steps and stepped once per optimizer step (train.py).
            step_scheduler_with_optimizer=False,
            log_with=tracking.trackers(cfg.report_to, cfg.output_dir, cfg.project_name, cfg.run_name),
            project_dir=cfg.output_dir,
            # Shuffles of (seed, epoch) alone: a resume replays the data order. On a GPU, pinned batches are copied
            # without the host waiting for the previous step to finish.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed,
                                                      non_blocking=has_cuda),
            kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if distributed and not has_cuda else [],
        )
    print("".join(line for line in said.getvalue().splitlines(keepends=True)
                  if verbose() or not line.endswith("built successfully\n")), end="")
    if accelerator.state.deepspeed_plugin is not None:
        from .deepspeed_config import complete_the_plugin

        complete_the_plugin(accelerator.state.deepspeed_plugin, cfg.max_grad_norm, load_universal)
    return accelerator


def speed_up(model: torch.nn.Module, cfg: TrainConfig, accelerator: Accelerator) -> dict:
    """TF32, Liger's kernels and torch.compile as their flags ask, applied to `model` in place before
    `accelerator.prepare` (textclf/speedups.py); what was applied, for run.json."""
    settings = resolve_speed(cfg, accelerator.device.type == "cuda", accelerator.distributed_type,
                             accelerator.state.dynamo_plugin, getattr(model.config, "model_type", None))
    settings["padding_multiple"] = padding_multiple(cfg, accelerator)
    # Set either way on a GPU: a launch with a dynamo backend and no mixed precision has accelerate turn TF32 on.
    if accelerator.device.type == "cuda":
        precision = "tf32" if settings["tf32"] else "ieee"
        set_for_the_run(torch.backends.cuda.matmul, "fp32_precision", precision)
        set_for_the_run(torch.backends.cudnn.conv, "fp32_precision", precision)
    if settings["use_liger_kernel"]:
        from .speedups import apply_liger

        apply_liger(model)
    if settings["torch_compile"]:
        from .speedups import compile_model

        compile_model(model, settings["torch_compile"], accelerator)
    return settings


def resolve_speed(cfg: TrainConfig, cuda: bool, distributed_type: DistributedType, dynamo_plugin,
                  model_type: Optional[str]) -> dict:
    """{tf32, use_liger_kernel, torch_compile (its keywords, or None)}: the flags, with auto (None) decided by the
    hardware, the launch and the model's family; a value the run cannot honour is refused."""
    compile_kwargs = None
    if compiles(cfg, cuda, distributed_type, dynamo_plugin):
        from .speedups import compile_options

        compile_kwargs = compile_options(dynamo_plugin)
    liger = False
    if cfg.use_liger_kernel or (cfg.use_liger_kernel is None and cuda):
        from .speedups import use_liger

        liger = use_liger(cfg.use_liger_kernel, cuda, model_type)
    return {"tf32": cuda if cfg.tf32 is None else cfg.tf32 and cuda, "use_liger_kernel": liger,
            "torch_compile": compile_kwargs}


def compiles(cfg: TrainConfig, cuda: bool, distributed_type: DistributedType, dynamo_plugin) -> bool:
    """Whether the run compiles its blocks: --torch_compile, or auto: with CUDA for one process or DDP, or when the
    launch asks for a dynamo backend."""
    launched = dynamo_plugin.backend != DynamoBackend.NO
    if cfg.torch_compile is False and launched:
        raise InputError(f"--torch_compile false, but the launch asks for dynamo_backend "
                         f"{dynamo_plugin.backend.value.lower()}: leave one of them out")
    sharded = distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
    return cfg.torch_compile if cfg.torch_compile is not None else launched or (cuda and not sharded)


def padding_multiple(cfg: TrainConfig, accelerator: Accelerator) -> Optional[int]:
    """What batch lengths are padded up to a multiple of: compiling, max_length / 8 rounded up to a multiple of 8
    (at most 8 buckets, each compiled once); else 8 in 16-bit precision, tensor cores' multiple, and none in fp32."""
    if compiles(cfg, accelerator.device.type == "cuda", accelerator.distributed_type, accelerator.state.dynamo_plugin):
        return 8 * math.ceil(cfg.max_length / 64)
    return 8 if accelerator.mixed_precision != "no" else None


def describe(accelerator: Accelerator, cfg: TrainConfig) -> dict:
    """What ran: strategy, scale, precision and versions; logged at start and saved in run.json."""
    micro = cfg.per_device_train_batch_size
    plugin = accelerator.state.deepspeed_plugin
    return {
        "distributed_type": str(accelerator.distributed_type.value),
        "num_processes": accelerator.num_processes,
        "num_machines": int(os.environ.get("ACCELERATE_NUM_MACHINES", os.environ.get("GROUP_WORLD_SIZE", 1))),
        "mixed_precision": accelerator.mixed_precision,
        "zero_stage": plugin.zero_stage if plugin else None,
        "zero_offload": zero_offload(plugin.deepspeed_config.get("zero_optimization", {})) if plugin else None,
        "device": str(accelerator.device),
        "micro_batch_size": micro,
        "global_batch_size": micro * cfg.gradient_accumulation_steps * accelerator.num_processes,
        "versions": {"python": platform.python_version(), **{name: installed_version(name) for name in
                     ("torch", "accelerate", "transformers", "datasets", "deepspeed")}},
    }


def installed_version(package: str):
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def exit_finished_run() -> None:
    """End a finished distributed run's process (after `end_training`) without interpreter teardown: references
    to the destroyed process groups survive (DeepSpeed's engine, `_dp_group` on every parameter, `group=WORLD`
    defaults bound when deepspeed.comm is imported), so gloo's threads still run, and one that touches Python
    aborts the finished run (SIGABRT: `accelerate launch` returns 1). Every file and tracker is closed by now."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        exit_now(0)
