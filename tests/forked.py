"""train.py's ranks forked from a process that has already imported torch, transformers, accelerate and
DeepSpeed: a 2-process run without paying every process's imports at every launch (docs/development.md).

The environment each rank gets is the one `accelerate launch --config_file <zoo file>` gives it: accelerate's
own launch code reads the config file and writes its settings as ACCELERATE_* variables
(prepare_multi_gpu_env / prepare_deepspeed_cmd_env), and the variables torchrun sets for each rank are added
here. What this does not test is the launcher itself: a few tests per zoo file still run `accelerate launch`.

The ranks come from a fork server (multiprocessing's "forkserver", which imports PRELOADED once per test
process) rather than from the test process: a process forked after torch has started its thread pools (or
gloo its threads) may hang in them, and the test process runs torch itself.
"""

import atexit
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What a rank of train.py imports; `train` is train.py imported as a module (its launch code is under
# `if __name__ == "__main__"`).
PRELOADED = ["forked", "train", "deepspeed", "torch.distributed.run"]
# How long the other ranks of a failed run get to end after SIGTERM: one waiting in a collective for the
# failed rank never does. torchrun's own grace period.
STOP_GRACE_S = 30


def launch_env(config_file, num_processes: int, port: int, launch_args=()) -> dict[str, str]:
    """The environment `accelerate launch --config_file <config_file> --num_processes <n> <launch_args>` gives
    every rank, the rank's own variables (rank_env) excepted."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "--num_processes", str(num_processes),
                                               "--main_process_port", str(port), *map(str, launch_args), "train.py"])
    # A private function: it is where `accelerate launch` applies the config file's values to its arguments
    # (tests/journeys/test_zoo.py checks the environment it gives against a real launch).
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    # torchrun's default with several processes per machine.
    return {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "WORLD_SIZE": str(num_processes), "LOCAL_WORLD_SIZE": str(num_processes),
            "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": str(num_processes)}


def rank_env(env: dict[str, str], rank: int) -> dict[str, str]:
    if "WORLD_SIZE" not in env:  # `python train.py`: no launcher, no rank
        return env
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}


def rank_main(rank: int, args: list[str], env: dict[str, str], output: str) -> None:
    """One rank: train.py's `__main__` (parse, train, exit), its output in `output`.out and `output`.err."""
    for fd, suffix in ((1, ".out"), (2, ".err")):
        os.dup2(os.open(output + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(rank_env(env, rank))
    os.chdir(REPO)
    sys.argv = ["train.py", *args]
    import torch

    if "OMP_NUM_THREADS" in os.environ:  # torch read the variable when the server started
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    import train
    from textclf.cli import parse_config
    from textclf.errors import run_command
    from textclf.launch.process import exit_finished_run

    try:
        cfg = run_command(lambda: parse_config(args))
        run_command(lambda: train.check_command_line(cfg))
        cfg, resume = run_command(lambda: train.plan_run(cfg, args))
        run_command(lambda: train.check_launch_early(cfg))
        run_command(lambda: train.main(cfg, resume))
        exit_finished_run()
    finally:  # what the interpreter's exit runs after `python train.py` (multiprocessing's child skips it)
        atexit._run_exitfuncs()


def rank_output(path: Path) -> str:
    """What a rank wrote to `path`; nothing where it was stopped (another rank failed first) before it opened it."""
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""


def run_forked(args, num_processes, config_file, launch_args=(), env=None, timeout=900) -> subprocess.CompletedProcess:
    """train.py with `args` on `num_processes` ranks as `config_file` (and `launch_args`, such as
    `--mixed_precision bf16`) sets them up, the ranks forked after the imports; with config_file None, one
    process as `python train.py` runs it. Returns what `subprocess.run` would for the launch: the first failed
    rank's exit code (the others are then stopped, as torchrun stops them), and every rank's output, rank 0's
    first."""
    from conftest import OFFLINE, free_port

    assert config_file or num_processes == 1, "several processes need a config file"
    port = free_port()
    launched = {**os.environ} if config_file is None else launch_env(config_file, num_processes, port, launch_args)
    shared_env = {**launched, **OFFLINE, **(env or {})}
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    outputs = Path(tempfile.mkdtemp(prefix="forked-")) / "rank"
    ranks = [context.Process(target=rank_main, args=(rank, list(map(str, args)), shared_env, f"{outputs}.{rank}"))
             for rank in range(num_processes)]
    for process in ranks:
        process.start()
    deadline, failed, timed_out = time.monotonic() + timeout, None, False
    while any(process.exitcode is None for process in ranks):
        if failed is None:
            failed = next((process for process in ranks if process.exitcode not in (None, 0)), None)
            if failed:  # as torchrun does: SIGTERM to the others, SIGKILL to those still there after a while
                deadline = min(deadline, time.monotonic() + STOP_GRACE_S)
                for process in ranks:
                    if process.exitcode is None:
                        os.kill(process.pid, signal.SIGTERM)
        if not timed_out and time.monotonic() > deadline:
            timed_out = failed is None
            for process in ranks:
                process.kill()
        time.sleep(0.1)
    failed = failed or next((process for process in ranks if process.exitcode != 0), None)
    read = [[Path(f"{outputs}.{rank}{suffix}") for rank in range(num_processes)] for suffix in (".out", ".err")]
    stdout, stderr = ("".join(map(rank_output, paths)) for paths in read)
    tails = [rank_output(path).splitlines()[-8:] for path in read[1]]
    shutil.rmtree(outputs.parent)
    if timed_out:  # where each rank was when it was stopped: the last lines of its output
        error = subprocess.TimeoutExpired(["forked train.py", *map(str, args)], timeout, stdout, stderr)
        error.add_note("\n".join(f"rank {rank}'s last lines: {' | '.join(tail)}" for rank, tail in enumerate(tails)))
        raise error
    return subprocess.CompletedProcess(["forked train.py", *map(str, args)], failed.exitcode if failed else 0,
                                       stdout, stderr)
