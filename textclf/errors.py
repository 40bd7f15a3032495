"""Errors the user must act on: one `error:` line that says what was wrong and what to do, exit code 2. Under a
launcher every rank meets such an error at the same point (train.py agrees on the ones a single rank finds), and
rank 0 alone reports it. What follows a failure is textclf/failure.py's, imported once something has failed."""

import os
import sys

from safetensors import SafetensorError


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
    """`main()`, ending as failure.exit_on says on an InputError or a collective whose peer ended; any other error
    keeps its traceback."""
    try:
        return main()
    except (InputError, RuntimeError) as e:  # RuntimeError: what a collective raises (torch's DistError is one too)
        from .failure import exit_on

        exit_on(e)
        raise  # a RuntimeError of another kind: a bug, which keeps its traceback


def exit_now(code: int) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()  # no interpreter teardown with gloo threads alive (runtime.exit_finished_run)
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
    could not be written, why, what this machine says about it, and `advice` (textclf/failure.py)."""
    from .failure import explain

    return explain(what, path, error, advice, advice_if_peer_ended)


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
    """Under torchrun, end when the launcher ends (textclf/ranks.py). Called first thing, before the heavy imports:
    a launcher killed before this line runs is not seen."""
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform.startswith("linux"):
        from .ranks import die_with_launcher

        die_with_launcher()
