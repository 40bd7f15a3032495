"""The run's process: what ran (describe_run: the log's first line and run.json), what a run changes in the process and
its libraries, put back when it ends however it ends (so that a second run in the same process, a notebook or a test,
starts as the first did), and how a finished distributed run's process ends.

What is changed: train.py's signal handlers, settings a run makes (set_for_the_run), and the silence of what libraries
say that a user cannot act on (TEXTCLF_VERBOSE=1 shows it), each by its message and module, never a whole category:
deprecations inside libraries, DeepSpeed's lines about its defaults, transformers' and datasets' bars.
"""

from __future__ import annotations

import functools
import logging
import platform
import signal
import threading
import warnings
from contextlib import ExitStack, contextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from textclf.config import TrainConfig
from textclf.errors import exit_now, verbose

from .deepspeed_config import zero_offload
from .launcher import launch_environment

if TYPE_CHECKING:  # accelerate is imported by train.py, after its pre-launch checks
    from accelerate import Accelerator

# (message, module the warning is attributed to), as regular expressions from the start. torch's deprecated
# collectives warn from the wrapper that logs their failures (c10d_logger), at every call DeepSpeed's ZeRO-3 makes.
WARNINGS = (
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", r"torch\.distributed\."),
    (r"`is_gradient_checkpointing` is deprecated", r"transformers\.modeling_utils"),  # read by peft
    (r"fan_in_fan_out is set to False but the target module is `Conv1D`", r"peft\.tuners\.lora"),  # GPT-2's layers
)

# What DeepSpeed logs that a user cannot act on: every process of a machine without GPUs falls back to the CPU
# accelerator, the only one; every rank resuming a ZeRO checkpoint was given no model-parallel unit (none is used).
DEEPSPEED_LINES = ("Setting accelerator to CPU", "MPU is not provided")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_open_scopes: list[ExitStack] = []  # the run scopes entered and not yet ended, innermost last


def set_for_the_run(owner, name: str, value) -> None:
    """`owner.name = value` until the innermost run scope ends (outside one, for good): TF32, dynamo's limits."""
    until_the_run_ends(functools.partial(setattr, owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def until_the_run_ends(undo) -> None:
    """Call `undo` when the innermost run scope ends (outside one, never): what a run set up in a library."""
    if _open_scopes:
        _open_scopes[-1].callback(undo)


@contextmanager
def run_scope():
    """The scope of one run (or one command)."""
    with ExitStack() as restore:
        _open_scopes.append(restore)
        restore.callback(_open_scopes.remove, restore)
        if threading.current_thread() is threading.main_thread():  # only there can handlers be set
            for stop_signal in STOP_SIGNALS:
                restore.callback(signal.signal, stop_signal, signal.getsignal(stop_signal))
        if not verbose():
            restore.enter_context(warnings.catch_warnings())  # the filters as they were, at the end
            for message, module in WARNINGS:
                warnings.filterwarnings("ignore", message=message, module=module)
            deepspeed = logging.getLogger("DeepSpeed")
            deepspeed.addFilter(actionable)
            restore.callback(deepspeed.removeFilter, actionable)
            restore.enter_context(progress_bars_off())
        yield


def scoped(function):
    """`function` run inside run_scope."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with run_scope():
            return function(*args, **kwargs)

    return wrapper


@contextmanager
def progress_bars_off():
    """transformers' and datasets' bars off meanwhile, each put back as it was."""
    import datasets
    from transformers.utils import logging as transformers_logging

    transformers_on, datasets_on = transformers_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if transformers_on:
            transformers_logging.enable_progress_bar()
        if datasets_on:
            datasets.enable_progress_bars()


def actionable(record: logging.LogRecord) -> bool:
    """A filter on DeepSpeed's logger: False for DEEPSPEED_LINES."""
    return verbose() or not record.getMessage().startswith(DEEPSPEED_LINES)


def describe_run(accelerator: Accelerator, cfg: TrainConfig) -> dict:
    """What ran: strategy, scale, precision and versions; logged at start and saved in run.json."""
    micro = cfg.per_device_train_batch_size
    plugin = accelerator.state.deepspeed_plugin
    return {
        "distributed_type": str(accelerator.distributed_type.value),
        "num_processes": accelerator.num_processes,
        "num_machines": launch_environment().num_machines,
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
    if launch_environment().world_size > 1:
        logging.shutdown()
        exit_now(0)
