"""The Accelerator for the hardware at hand, and the facts about a run worth recording."""

import contextlib
import copy
import io
import json
import logging
import os
import platform
import warnings
from importlib.metadata import PackageNotFoundError, version

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import DynamoBackend

from . import tracking
from .config import TrainConfig
from .errors import InputError, exit_now, verbose
from .launch import read_deepspeed_file, zero_offload

# torch.compile is refused rather than half supported: measured on a CPU it made training slower
# (docs/benchmark.md, "torch.compile"), and a compiled model's checkpoints name every weight `_orig_mod.<name>`.
COMPILE_REFUSED = ("train.py does not run under torch.compile: on a CPU it measured slower than eager "
                   "(docs/benchmark.md, \"torch.compile\"), and its checkpoints would name every weight _orig_mod.*, "
                   "which export, predict and a resume without it cannot read; launch with --dynamo_backend no")


def make_accelerator(cfg: TrainConfig, load_universal: bool = False) -> Accelerator:
    """One Accelerator for every zoo file, on GPUs and on a CPU-only machine alike. `load_universal`: ZeRO's
    states are to be loaded from DeepSpeed's universal checkpoint (a resume on another number of processes).

    Without CUDA, a DDP yaml needs `cpu=True` to form a gloo process group (otherwise each rank
    runs alone), while DeepSpeed needs `cpu=False` and an explicit gloo backend (`cpu=True` would
    switch DeepSpeed off and silently run plain DDP).
    """
    has_cuda = torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if deepspeed and ds_file != "none":  # before anything is built: DeepSpeed itself reads it only at prepare()
        check_deepspeed_config(read_deepspeed_file(ds_file), ds_file)
    if deepspeed and not has_cuda:
        from .deepspeed_ops import load_deepspeed_ops

        load_deepspeed_ops(["ShareMemCommBuilder"])  # what deepspeed.comm loads on a CPU, when the Accelerator starts
    if not verbose():  # DeepSpeed's calls of a torch function that torch deprecated: not the user's to fix
        warnings.filterwarnings("ignore", message=".*torch.distributed.all_gather_into_tensor.* is deprecated",
                                category=FutureWarning)
    with contextlib.redirect_stdout(io.StringIO()) as said:  # DeepSpeed prints "... built successfully" per rank
        accelerator = Accelerator(
            cpu=not has_cuda and not deepspeed,
            mixed_precision=cfg.mixed_precision,  # None: the launch's (ACCELERATE_MIXED_PRECISION), or "no"
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            # The schedule is defined in optimizer steps and stepped once per optimizer step (train.py).
            step_scheduler_with_optimizer=False,
            log_with=tracking.trackers(cfg.report_to, cfg.output_dir, cfg.project_name, cfg.run_name),
            project_dir=cfg.output_dir,
            # Per-epoch shuffles that depend on (seed, epoch) only: what makes resume replay the data order.
            # On a GPU, batches (pinned by the loaders) are copied without the host waiting for the device:
            # a blocking copy would wait for the previous step to finish before the next could be queued.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed,
                                                      non_blocking=has_cuda),
            kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if distributed and not has_cuda else [],
        )
    print("".join(line for line in said.getvalue().splitlines(keepends=True)
                  if verbose() or not line.endswith("built successfully\n")), end="")
    dynamo_backend = accelerator.state.dynamo_plugin.backend
    if dynamo_backend != DynamoBackend.NO:
        raise InputError(f"dynamo_backend is {dynamo_backend.value.lower()}: {COMPILE_REFUSED}")
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.deepspeed_config.get("gradient_clipping") == "auto":
        # Accelerate would fill "auto" with 1.0; the training config is the one source of truth.
        plugin.deepspeed_config["gradient_clipping"] = cfg.max_grad_norm
    if plugin is not None and load_universal:
        plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    if plugin is not None and zero_offload(plugin.deepspeed_config.get("zero_optimization", {}))["optimizer"] != "none":
        from .deepspeed_ops import load_deepspeed_ops

        load_deepspeed_ops(["CPUAdamBuilder"])  # DeepSpeedCPUAdam, which accelerate swaps in at prepare()
    return accelerator


def check_deepspeed_config(config: dict, place: str) -> None:
    """Refuse now what DeepSpeed would refuse when its engine starts: a key it does not know or a value it does
    not take in a section it models (zero_optimization, fp16, bf16, ...), e.g. "stage": 4 or "stagee".

    DeepSpeed's own parsing of every section does the checking, with the "auto" values that accelerate fills
    in at prepare() left out as DeepSpeed leaves them out.
    """
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    # DeepSpeedConfig's __init__ parses the sections (its private _initialize_params), then does batch-size
    # arithmetic that needs the process group and the values accelerate has not filled in yet: only the first
    # part runs here (test_oneline's DeepSpeed JSON tests fail if it changes).
    parsed = object.__new__(DeepSpeedConfig)
    try:
        parsed._initialize_params(copy.deepcopy(config))
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(map(str, first["loc"]))
        got = f" (got {json.dumps(first['input'], default=str)})" if first["type"] != "extra_forbidden" else ""
        raise InputError(f"{place}: DeepSpeed refuses it: {e.title} {key}: {first['msg']}{got}") from None
    except (ValueError, TypeError, AssertionError, KeyError) as e:
        raise InputError(f"{place}: DeepSpeed refuses it: {(str(e).splitlines() or [type(e).__name__])[0]}") from None


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
    """End the process of a finished distributed run (after `accelerator.end_training()`) without
    interpreter teardown; a single process exits normally.

    `end_training` destroys the process groups, but references to them survive it: DeepSpeed's
    engine and optimizer, `_dp_group` on every parameter, `deepspeed.utils.groups`, and even in DDP
    runs `group=WORLD` defaults bound when deepspeed.comm is imported. So gloo's C++ threads are
    still running while the interpreter tears down, and one that touches Python then aborts the
    finished run ("terminate called without an active exception", SIGABRT: `accelerate launch`
    returns 1). Every file of the run is closed and every tracker finished by now: only the
    teardown is skipped.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        exit_now(0)
