"""What a rank other than the one that failed does under a launch of several processes: it tells a collective that
failed because another rank ended from a failure of its own, and, when it meets the same error as rank 0, keeps
quiet until the launcher stops it, so that the user reads the error once. Imported only under such a launch, when
something has failed (textclf/failure.py), and under torchrun: a rank ends with its launcher, and leaves its error in
the file the launcher reports from.
"""

import ctypes
import json
import os
import re
import signal
import sys
import time
import traceback

from . import errors

# How long a rank other than 0 keeps its error to itself, waiting for the launcher to stop it once rank 0
# has reported the same error; a rank that is still running then reports its own.
QUIET_RANK_WAIT_S = 10


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


def wait_to_be_stopped() -> None:
    """A rank other than 0 with an error to report: ended by the launcher's signal, quietly (no traceback), or
    after QUIET_RANK_WAIT_S, when it reports its own."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    if errors.stop_signals:  # the launcher's SIGTERM came first, to train.py's handler: it ends this rank now
        os.kill(os.getpid(), signal.Signals[errors.stop_signals[0]])
    time.sleep(QUIET_RANK_WAIT_S)


def die_with_launcher() -> None:
    """errors.die_with_launcher: torchrun starts each rank in a session of its own and stops them when it is stopped
    (SIGTERM, SIGINT, `timeout`), but a launcher killed outright (SIGKILL, the OOM killer) stops nothing: its ranks
    would train on, unseen, into the same output_dir. The kernel kills them instead (PR_SET_PDEATHSIG). A plain
    `python train.py` keeps running when its shell exits (nohup)."""
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG (linux/prctl.h)
    if os.getppid() != parent:  # the launcher ended before the line above
        os.kill(os.getpid(), signal.SIGKILL)


def write_error_file(lines: str) -> None:
    """The error in torch's error-file format for a message without a traceback (its ErrorHandler always adds one),
    which the launcher's report quotes as the root cause."""
    try:
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w", encoding="utf-8") as f:
            json.dump({"message": lines, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the launcher's report then points to torch's docs instead; the error line still says it
