"""The error path, imported only once something has failed: an error said as its `error:` line(s) and the exit
(errors.run_command), rank 0's alone under a launch (the others keep quiet until the launcher stops them, whose report
of the failed ranks quotes it as the root cause), what a write that failed means (errors.write_failed), and a
diverged run's remedy."""

import errno
import os
import re
import resource
import shutil
import sys

from tqdm import tqdm

from .errors import InputError, exit_now

# What a rank says when a collective failed because another rank ended (killed, or stopped by its own error).
PEER_ENDED = "another process of this run ended"

# torch.save's words for a write that failed (its stream writer, PyTorchStreamWriter in inline_container.cc).
TORCH_WRITE_FAILED = re.compile(r"inline_container|PytorchStreamWriter|unexpected pos|file write failed")
# A file system that refused a write with less free space than this is full: a write that does not fit fills it
# to its last blocks before it fails.
FULL_BELOW_BYTES = 2 ** 20
OUT_OF_MEMORY_ADVICE = ("the disk is not the cause: free memory (a smaller --per_device_train_batch_size or "
                        "--per_device_eval_batch_size, fewer processes per GPU, or an offload file such as "
                        "accelerate_configs/zero3_offload.yaml: a ZeRO-3 save gathers the 16-bit weights on each "
                        "GPU), then run again")


def exit_on(error: Exception) -> None:
    """errors.run_command's exit: an InputError's line(s) and exit code 2; a collective that failed because another
    process ended, one line and exit code 1 (that process says why). Returns for any other error."""
    if isinstance(error, InputError):
        report(error)
        exit_now(2)
    if peer_ended(error):
        report(InputError(f"{PEER_ENDED} ({gist(error)}); its own message or the launcher's report says why"))
        exit_now(1)


def peer_ended(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another process of the run is gone (textclf/ranks.py)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not isinstance(error, RuntimeError):
        return False
    from .ranks import collective_failed_for_a_peer

    return collective_failed_for_a_peer(error)


def gist(error: BaseException) -> str:
    """The first sentence of a library's error, without the source location gloo puts in front of it."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0].rstrip(".")


def report(error: InputError) -> None:
    """`error` as its `error:` line(s), said once under a launch."""
    lines = "\n".join(f"error: {line}" for line in str(error).splitlines())
    # A progress bar left open ends its line first. tqdm lists its open bars only in the private _instances (no
    # public list); test_oneline fails if that changes.
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    if int(os.environ.get("RANK", "0")) > 0:
        from .ranks import wait_to_be_stopped

        wait_to_be_stopped()
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # set by torchrun for each rank it starts
        from .ranks import write_error_file

        write_error_file(lines)
    print(lines, file=sys.stderr, flush=True)


def out_of_memory(error: BaseException) -> bool:
    """torch's out-of-memory error (CUDA's, which ZeRO-3 may raise while it gathers the weights to save them), or
    the words of a library that reports one as a plain RuntimeError."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(error, (RuntimeError, MemoryError)) and "out of memory" in str(error).lower()


def explain(what: str, path: str, error: Exception, advice: str, advice_if_peer_ended: str = "") -> Exception:
    """errors.write_failed: its true cause first (out of memory, a peer that ended: DeepSpeed's save is collective),
    a RuntimeError that is not torch.save's failed write returned as it is (a bug keeps its traceback), then what
    this machine says. torch.save loses the errno: a file system left (nearly) full is named full."""
    if out_of_memory(error):
        return InputError(f"cannot {what} {path}: out of memory ({gist(error)}); {OUT_OF_MEMORY_ADVICE}")
    if peer_ended(error):
        return InputError(f"cannot {what} {path}: {PEER_ENDED} ({gist(error)}); its own message or the launcher's "
                          "report says why" + (f"; {advice_if_peer_ended}" if advice_if_peer_ended else ""))
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


def diverged(where: str, output_dir: str, learning_rate: float, clipping: bool) -> InputError:
    """divergence.DivergenceWatch's error: a resume repeats the same steps (and refuses another --learning_rate), so
    the remedy is a new run."""
    from .checkpoint import complete_checkpoints

    found = complete_checkpoints(output_dir)
    last_good = (f"the last good checkpoint is {found[-1][1]} (resumed, it repeats these steps)" if found
                 else "no checkpoint was saved before it")
    clip = "" if clipping else " (or clip gradients with --max_grad_norm 1.0)"
    return InputError(f"training diverged at {where}; the learning rate {learning_rate:g} is likely too high. "
                      f"Nothing of it was saved: {last_good}; start a new run with a lower --learning_rate{clip}")
