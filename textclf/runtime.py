"""The Accelerator for the hardware at hand, and the facts about a run worth recording."""

import logging
import os
import platform
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import DynamoBackend, is_wandb_available

from .config import TrainConfig
from .errors import InputError

# torch.compile is refused rather than half supported: measured on a CPU it made training slower
# (docs/benchmark.md, "torch.compile"), and a compiled model's checkpoints name every weight `_orig_mod.<name>`.
COMPILE_REFUSED = ("train.py does not run under torch.compile: on a CPU it measured slower than eager "
                   "(docs/benchmark.md, \"torch.compile\"), and its checkpoints would name every weight _orig_mod.*, "
                   "which export, predict and a resume without it cannot read; launch with --dynamo_backend no")


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    """One Accelerator for every zoo file, on GPUs and on a CPU-only machine alike.

    Without CUDA, a DDP yaml needs `cpu=True` to form a gloo process group (otherwise each rank
    runs alone), while DeepSpeed needs `cpu=False` and an explicit gloo backend (`cpu=True` would
    switch DeepSpeed off and silently run plain DDP).
    """
    has_cuda = torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    precision = resolve_precision(cfg.mixed_precision)
    if precision == "fp16" and not has_cuda:
        raise InputError("mixed_precision fp16 needs a CUDA GPU (on a CPU it would silently run fp32); "
                         "use bf16 or no on this machine")
    check_trackers(cfg.report_to)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    trackers = {"none": None, "all": "all"}.get(cfg.report_to, [cfg.report_to])
    accelerator = Accelerator(
        cpu=not has_cuda and not deepspeed,
        mixed_precision=cfg.mixed_precision,  # None: the launch's (ACCELERATE_MIXED_PRECISION), or "no"
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        # The schedule is defined in optimizer steps and stepped once per optimizer step (train.py).
        step_scheduler_with_optimizer=False,
        log_with=trackers,
        project_dir=cfg.output_dir,
        # Per-epoch shuffles that depend on (seed, epoch) only: what makes resume replay the data order.
        # On a GPU, batches (pinned by the loaders) are copied without the host waiting for the device:
        # a blocking copy would wait for the previous step to finish before the next could be queued.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed,
                                                  non_blocking=has_cuda),
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if distributed and not has_cuda else [],
    )
    dynamo_backend = accelerator.state.dynamo_plugin.backend
    if dynamo_backend != DynamoBackend.NO:
        raise InputError(f"dynamo_backend is {dynamo_backend.value.lower()}: {COMPILE_REFUSED}")
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.deepspeed_config.get("gradient_clipping") == "auto":
        # Accelerate would fill "auto" with 1.0; the training config is the one source of truth.
        plugin.deepspeed_config["gradient_clipping"] = cfg.max_grad_norm
    return accelerator


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


def check_trackers(report_to: str) -> None:
    """Stop now, before anything is written, if a tracker asked for cannot start.

    Accelerate drops a tracker whose package is missing without a word (a debug log), and wandb
    without a login fails only in `init_trackers`, after run.json is written.
    """
    if report_to == "tensorboard":
        try:
            import torch.utils.tensorboard  # noqa: F401  (what accelerate's TensorBoardTracker imports)
        except ImportError as e:
            raise InputError(f"--report_to tensorboard, but tensorboard cannot be imported ({e}); "
                             "pip install tensorboard, or pass --report_to none") from None
    if report_to == "wandb" or (report_to == "all" and is_wandb_available()):
        try:
            import wandb
        except ImportError as e:
            raise InputError(f"--report_to {report_to}, but wandb cannot be imported ({e}); "
                             "pip install wandb, or pass --report_to tensorboard or none") from None
        offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun")
        if not offline and not wandb.login(verify=False, prompt=False):
            raise InputError(f"--report_to {report_to}, but wandb has no login here (no WANDB_API_KEY, no "
                             "`wandb login`); log in, set WANDB_MODE=offline, or pass --report_to tensorboard or none")


def zero_offload(zero_optimization: dict) -> dict[str, str]:
    """Where DeepSpeed keeps optimizer states and parameters, read from the `zero_optimization` section
    of its config (run.json, the check and the benchmark all read it here): {"optimizer": "cpu", "param": "none"}."""
    return {part: zero_optimization.get(f"offload_{part}", {}).get("device", "none") for part in ("optimizer", "param")}


def describe(accelerator: Accelerator, cfg: TrainConfig) -> dict:
    """What ran: strategy, scale, precision and versions; logged at start and saved in run.json."""
    import accelerate
    import datasets
    import transformers

    try:
        import deepspeed
        deepspeed_version = deepspeed.__version__
    except ImportError:
        deepspeed_version = None
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
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "accelerate": accelerate.__version__,
            "transformers": transformers.__version__,
            "datasets": datasets.__version__,
            "deepspeed": deepspeed_version,
        },
    }


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
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

