"""The error path. Bad input is an InputError: one `error:` line per line of its message that says what was wrong
and what to do, exit code 2, nothing half written. Under a launch of several processes every rank meets such an
error at the same point (a check made on one rank is broadcast: checked_on_main_process), and rank 0 alone says it;
the others keep quiet until the launcher stops them, whose report quotes rank 0's line as the root cause. A
collective that failed because another rank ended is one line and exit code 1; a failed write is what could not be
written and why. This module reads the launch's rank and world size from the environment itself: it must work
before anything else has run, whatever else has failed.
"""

import ctypes
import errno
import json
import os
import re
import resource
import shutil
import signal
import sys
import time
import traceback

from safetensors import SafetensorError
from tqdm import tqdm


class InputError(Exception):
    """Something the user must fix (bad input, a full disk, a folder in use by another run): an `error:` line per
    line of the message, exit code 2, nothing half written."""


# What a failed write may raise: torch.save's is a RuntimeError (its errno lost), as are an out-of-memory error and
# a failed collective: write_failed tells them apart.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)

# The stop signals this process received, by name (train.py asks for a checkpoint on SIGTERM and SIGINT): the
# launcher's SIGTERM to the other ranks, once one has failed, may come while they wait in a collective.
stop_signals: list[str] = []


def run_command(main):
    """`main()`, ending as exit_on says on an InputError or a collective whose peer ended; any other error keeps
    its traceback."""
    try:
        return main()
    except (InputError, RuntimeError) as e:  # RuntimeError: what a collective raises (torch's DistError is one too)
        exit_on(e)
        raise  # a RuntimeError of another kind: a bug, which keeps its traceback


def exit_on(error: Exception) -> None:
    """run_command's exit: an InputError's line(s) and exit code 2; a collective that failed because another
    process ended, one line and exit code 1 (that process says why). Returns for any other error."""
    if isinstance(error, InputError):
        report(error)
        exit_now(2)
    if peer_ended(error):
        report(InputError(f"{PEER_ENDED} ({gist(error)}); its own message or the launcher's report says why"))
        exit_now(1)


def report(error: InputError) -> None:
    """`error` as its `error:` line(s), said once under a launch."""
    lines = "\n".join(f"error: {line}" for line in str(error).splitlines())
    # A progress bar left open ends its line first. tqdm lists its open bars only in the private _instances (no
    # public list); test_oneline fails if that changes.
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    if int(os.environ.get("RANK", "0")) > 0:
        wait_to_be_stopped()
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # set by torchrun for each rank it starts
        write_error_file(lines)
    print(lines, file=sys.stderr, flush=True)


def exit_now(code: int) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()  # no interpreter teardown with gloo threads alive
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def say(line: str, file=None) -> None:
    """Print `line` from rank 0 alone: under a launch every rank reads the same data and would say it again."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, file=file or sys.stdout, flush=True)


def verbose() -> bool:
    """TEXTCLF_VERBOSE=1: the libraries' warnings that textclf silences or shortens are shown as they are."""
    return os.environ.get("TEXTCLF_VERBOSE", "") not in ("", "0")


def write_failed(what: str, path: str, error: Exception, advice: str, advice_if_peer_ended: str = "") -> Exception:
    """A write that failed (full disk, quota, file size limit, permissions, a link in the way) as one line: what
    could not be written, its true cause first (out of memory, a peer that ended: DeepSpeed's save is collective),
    then what this machine says, and `advice`. A RuntimeError that is not torch.save's failed write is returned as
    it is (a bug keeps its traceback). torch.save loses the errno: a file system left (nearly) full is named full."""
    if out_of_memory(error):
        return InputError(f"cannot {what} {path}: out of memory ({gist(error)}); {OUT_OF_MEMORY_ADVICE}")
    if peer_ended(error):
        return InputError(f"cannot {what} {path}: {PEER_ENDED} ({gist(error)}); its own message or the launcher's "
                          "report says why" + (f"; {advice_if_peer_ended}" if advice_if_peer_ended else ""))
    if isinstance(error, RuntimeError) and not TORCH_WRITE_FAILED.search(str(error)):
        return error
    link = error.filename if isinstance(error, OSError) and error.errno in (errno.ELOOP, errno.EEXIST) else None
    if isinstance(link, str) and os.path.islink(link):  # files.py opens with O_NOFOLLOW, O_EXCL
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


# torch.save's words for a write that failed (its stream writer, PyTorchStreamWriter in inline_container.cc).
TORCH_WRITE_FAILED = re.compile(r"inline_container|PytorchStreamWriter|unexpected pos|file write failed")

# A file system that refused a write with less free space than this is full: a write that does not fit fills it
# to its last blocks before it fails.
FULL_BELOW_BYTES = 2 ** 20

OUT_OF_MEMORY_ADVICE = ("the disk is not the cause: free memory (a smaller --per_device_train_batch_size or "
                        "--per_device_eval_batch_size, fewer processes per GPU, or an offload file such as "
                        "accelerate_configs/zero3_offload.yaml: a ZeRO-3 save gathers the 16-bit weights on each "
                        "GPU), then run again")


def out_of_memory(error: BaseException) -> bool:
    """torch's out-of-memory error (CUDA's, which ZeRO-3 may raise while it gathers the weights to save them), or
    the words of a library that reports one as a plain RuntimeError."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(error, (RuntimeError, MemoryError)) and "out of memory" in str(error).lower()


# What a rank says when a collective failed because another rank ended (killed, or stopped by its own error).
PEER_ENDED = "another process of this run ended"


def peer_ended(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another process of the run is gone."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not isinstance(error, RuntimeError):
        return False
    return collective_failed_for_a_peer(error)


def collective_failed_for_a_peer(error: RuntimeError) -> bool:
    """Whether `error` is a collective (torch.distributed's, which DeepSpeed's go through) that failed because
    another process of the run is gone: gloo raises a RuntimeError from inside the collective, NCCL one of
    torch's DistError. A failed write is an OSError, or a RuntimeError raised by torch.save, not in c10d."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and isinstance(error, getattr(distributed, "DistError", ())):
        return True
    in_collective = any(frame.f_code.co_filename.endswith(os.path.join("distributed", "distributed_c10d.py"))
                        for frame, _ in traceback.walk_tb(error.__traceback__))
    # DDP's gradient all-reduce runs in the autograd engine, with no Python frame of c10d: gloo's words then.
    return in_collective or bool(re.search(r"Connection (closed|reset) by peer|gloo/transport", str(error)))


def gist(error: BaseException) -> str:
    """The first sentence of a library's error, without the source location gloo puts in front of it."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0].rstrip(".")


def checked_on_main_process(accelerator, check):
    """Run `check` on the main process alone (collective: every rank calls it) and return what it returned, on every
    rank; if it raises an InputError, every rank raises it, so that the run stops as one and rank 0 reports it."""
    from accelerate.utils import broadcast_object_list

    message = result = None
    if accelerator.is_main_process:
        try:
            result = check()
        except InputError as e:
            message = str(e)
    message, result = broadcast_object_list([message, result])
    if message is not None:
        raise InputError(message)
    return result


# How long a rank other than 0 keeps its error to itself, waiting for the launcher to stop it once rank 0
# has reported the same error; a rank that is still running then reports its own.
QUIET_RANK_WAIT_S = 10


def wait_to_be_stopped() -> None:
    """A rank other than 0 with an error to report: ended by the launcher's signal, quietly (no traceback), or
    after QUIET_RANK_WAIT_S, when it reports its own."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    if stop_signals:  # the launcher's SIGTERM came first, to train.py's handler: it ends this rank now
        os.kill(os.getpid(), signal.Signals[stop_signals[0]])
    time.sleep(QUIET_RANK_WAIT_S)


def write_error_file(lines: str) -> None:
    """The error in torch's error-file format for a message without a traceback (its ErrorHandler always adds one),
    which the launcher's report quotes as the root cause."""
    try:
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w", encoding="utf-8") as f:
            json.dump({"message": lines, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the launcher's report then points to torch's docs instead; the error line still says it


def die_with_launcher() -> None:
    """Under torchrun, end when the launcher ends. torchrun starts each rank in a session of its own and stops them
    when it is stopped (SIGTERM, SIGINT, `timeout`), but a launcher killed outright (SIGKILL, the OOM killer) stops
    nothing: its ranks would train on, unseen, into the same output_dir. The kernel kills them instead
    (PR_SET_PDEATHSIG). Called first thing, before the heavy imports: a launcher killed before this line runs is not
    seen. A plain `python train.py` keeps running when its shell exits (nohup)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG (linux/prctl.h)
    if os.getppid() != parent:  # the launcher ended before the line above
        os.kill(os.getpid(), signal.SIGKILL)
