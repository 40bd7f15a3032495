"""What a run changes in the process and its libraries, put back when it ends however it ends, so that a second run
in the same process (a notebook, a test) starts as the first did: train.py's signal handlers, and the silence of
what libraries say that a user cannot act on (TEXTCLF_VERBOSE=1 shows it), each by its message and module, never
a whole category: deprecations inside libraries, DeepSpeed's lines about its defaults, transformers' and datasets'
bars.
"""

import functools
import logging
import signal
import threading
import warnings
from contextlib import ExitStack, contextmanager

from .errors import verbose

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
