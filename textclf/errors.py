"""Errors the user must act on: one `error:` line that says what was wrong and what to do, exit code 2.

Under a launcher (`accelerate launch`, torchrun) every rank meets such an error at the same point
(train.py agrees on the ones a single rank finds): rank 0 reports it, the other ranks keep quiet
until the launcher stops them, so the user reads it once. The launcher then prints its own report
of the failed ranks (torch's ChildFailedError) below it; that report quotes the error as its root
cause instead of pointing to a traceback a user's error does not have.
"""

import ctypes
import errno
import json
import logging
import os
import re
import resource
import shutil
import signal
import sys
import time

from safetensors import SafetensorError


class InputError(Exception):
    """Something the user must fix (bad input, a full disk, a folder in use by another run): reported as
    one line (one per line of the message), exit code 2, nothing half written."""


# What a failed write may raise: OSError from Python, RuntimeError from torch.save ("unexpected pos ...", the
# errno is lost), SafetensorError from safetensors. A RuntimeError is also what an out-of-memory error and a
# failed collective are: write_failed tells them apart.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)
# torch.save's words for a write that failed (its stream writer, PyTorchStreamWriter in inline_container.cc).
TORCH_WRITE_FAILED = re.compile(r"inline_container|PytorchStreamWriter|unexpected pos|file write failed")
# A file system that refused a write with less free space than this is full: a write that does not fit fills it
# to its last blocks before it fails.
FULL_BELOW_BYTES = 2 ** 20
OUT_OF_MEMORY_ADVICE = ("the disk is not the cause: free memory (a smaller --per_device_train_batch_size or "
                        "--per_device_eval_batch_size, fewer processes per GPU, or an offload file such as "
                        "accelerate_configs/zero3_offload.yaml: a ZeRO-3 save gathers the 16-bit weights on each "
                        "GPU), then run again")
# What a rank says when a collective failed because another rank ended (killed, or stopped by its own error).
PEER_ENDED = "another process of this run ended"
# The stop signals this process received, by name (train.py asks for a checkpoint on SIGTERM and SIGINT): the
# launcher's SIGTERM to the other ranks, once one has failed, may come while they wait in a collective.
stop_signals: list[str] = []


def run_command(main):
    """Run a command's `main` and return what it returns, turning an InputError into its `error:` line(s)
    and exit code 2, and a collective that failed because another process ended into one line (exit code 1):
    that process says why, or said it already."""
    try:
        return main()
    except InputError as e:
        report(e)
        exit_now(2)
    except RuntimeError as e:  # what a collective raises (torch's DistError is one too)
        if not peer_ended(e):
            raise
        report(InputError(f"{PEER_ENDED} ({gist(e)}); its own message or the launcher's report says why"))
        exit_now(1)


def exit_now(code: int) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()  # no interpreter teardown with gloo threads alive (runtime.exit_finished_run)
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def peer_ended(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another process of the run is gone (textclf/ranks.py
    tells, under a launch of several processes)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not isinstance(error, RuntimeError):
        return False
    from .ranks import collective_failed_for_a_peer

    return collective_failed_for_a_peer(error)


def gist(error: BaseException) -> str:
    """The first sentence of a library's error, without the source location gloo puts in front of it."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0].rstrip(".")


def report(error: InputError) -> None:
    from tqdm import tqdm

    lines = "\n".join(f"error: {line}" for line in str(error).splitlines())
    # A progress bar left open ends its line first. tqdm lists its open bars only in the private _instances (no
    # public list); test_oneline fails if that changes.
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    if int(os.environ.get("RANK", "0")) > 0:
        from .ranks import wait_to_be_stopped

        wait_to_be_stopped()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torchrun for each rank it starts
    if error_file:
        # torch's error-file format for a message without a traceback (its ErrorHandler always adds one).
        try:
            with open(error_file, "w", encoding="utf-8") as f:
                json.dump({"message": lines, "timestamp": int(time.time())}, f)
        except OSError:
            pass  # the launcher's report then points to torch's docs instead; the line below still says it
    print(lines, file=sys.stderr, flush=True)


def say(line: str, file=None) -> None:
    """Print `line` from rank 0 alone: under a launch every rank reads the same data and would say it again."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, file=file or sys.stdout, flush=True)


def verbose() -> bool:
    """TEXTCLF_VERBOSE=1: the libraries' warnings that textclf silences or shortens are shown as they are."""
    return os.environ.get("TEXTCLF_VERBOSE", "") not in ("", "0")


def actionable(record: logging.LogRecord) -> bool:
    """A logging filter on DeepSpeed's logger, for a run (textclf/quiet.py): False for what it logs that a user cannot
    act on. It tells every process of a machine without GPUs that it falls back to its CPU accelerator, which is the
    only one, and every rank resuming a ZeRO checkpoint that no model-parallel unit was given (none is used)."""
    return verbose() or not record.getMessage().startswith(("Setting accelerator to CPU", "MPU is not provided"))


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an out-of-memory error: torch's (CUDA's, which ZeRO-3 may raise while it gathers the
    weights to save them), or the words of a library that reports one as a plain RuntimeError."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(error, (RuntimeError, MemoryError)) and "out of memory" in str(error).lower()


def write_failed(what: str, path: str, error: Exception, advice: str) -> Exception:
    """A write that failed (full disk, quota, file size limit, permissions, a symbolic link in the way) as one
    line: what could not be written, why, what this machine says about it, and what to do.

    Its true cause first: an out-of-memory error or a collective whose peer ended is said as such, not as a
    failed write, and a RuntimeError that is none of these nor torch.save's failed write is returned as it is
    (a bug keeps its traceback). torch.save loses the errno: a file system left (nearly) full is named full."""
    if out_of_memory(error):
        return InputError(f"cannot {what} {path}: out of memory ({gist(error)}); {OUT_OF_MEMORY_ADVICE}")
    if peer_ended(error):
        return InputError(f"cannot {what} {path}: {PEER_ENDED} ({gist(error)}); its own message or the launcher's "
                          "report says why")
    if isinstance(error, RuntimeError) and not TORCH_WRITE_FAILED.search(str(error)):
        return error
    link = error.filename if isinstance(error, OSError) and error.errno in (errno.ELOOP, errno.EEXIST) else None
    if isinstance(link, str) and os.path.islink(link):  # textclf/files.py: O_NOFOLLOW, O_EXCL
        return InputError(f"cannot {what} {path}: {link} is a symbolic link (to {os.readlink(link)}), and a run "
                          "never writes through one; remove the link (or choose another folder), then run again")
    reason = (error.strerror if isinstance(error, OSError) and error.strerror else
              (str(error).strip().splitlines() or [type(error).__name__])[0])
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    facts = f"{free / 2 ** 20:.1f} MiB free on its file system"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        facts += f", files limited to {limit} bytes for this process (ulimit -f)"
    if not isinstance(error, OSError) and free < FULL_BELOW_BYTES:
        reason = os.strerror(errno.ENOSPC)
    elif not isinstance(error, OSError) and limit != resource.RLIM_INFINITY:
        reason = os.strerror(errno.EFBIG)
    return InputError(f"cannot {what} {path}: {reason} ({facts}); {advice}")


def checked_on_main_process(accelerator, check) -> None:
    """Run `check` on the main process alone (collective: every rank calls it); if it raises an InputError,
    every rank raises it, so that the run stops as one and rank 0 reports it."""
    from accelerate.utils import broadcast_object_list

    message = None
    if accelerator.is_main_process:
        try:
            check()
        except InputError as e:
            message = str(e)
    message = broadcast_object_list([message])[0]
    if message is not None:
        raise InputError(message)


def die_with_launcher() -> None:
    """Under torchrun (`accelerate launch` with several processes), end when the launcher ends.

    torchrun starts each rank in a session of its own and stops them when it is stopped (SIGTERM,
    SIGINT, `timeout`), but a launcher killed outright (SIGKILL, the OOM killer) stops nothing: its
    ranks would train on, unseen, into the same output_dir. The kernel kills them instead
    (PR_SET_PDEATHSIG). A plain `python train.py` keeps running when its shell exits (nohup). Called
    first thing, before the heavy imports: a launcher killed before this line runs is not seen.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG (linux/prctl.h)
    if os.getppid() != parent:  # the launcher ended before the line above
        os.kill(os.getpid(), signal.SIGKILL)
