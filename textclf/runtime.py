"""The Accelerator for the hardware at hand, and the facts about a run worth recording."""

import contextlib
import copy
import io
import json
import logging
import os
import platform
import signal
import sys
import time
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version

import psutil
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


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    """One Accelerator for every zoo file, on GPUs and on a CPU-only machine alike.

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
        load_deepspeed_ops(["ShareMemCommBuilder"])  # what deepspeed.comm loads on a CPU, when the Accelerator starts
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
    if plugin is not None and zero_offload(plugin.deepspeed_config.get("zero_optimization", {}))["optimizer"] != "none":
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


# DeepSpeed's C++ ops that launches compile at first use, by the names DeepSpeed's accelerator knows their
# builders, and about how many seconds compiling takes on a 2-core CPU (said when a launch compiles one).
COMPILE_SECONDS = {"ShareMemCommBuilder": 45, "CPUAdamBuilder": 60}
# File systems that other machines may share: a build lock there may belong to a build on another machine.
SHARED_FILE_SYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                       "fuse.sshfs", "9p", "afs", "panfs", "wekafs"}


def load_deepspeed_ops(names: list[str]) -> dict[str, float]:
    """Load (compiling at first use) DeepSpeed ops by builder name, saying so: {op: seconds it took}.

    DeepSpeed compiles with torch's cpp_extension into its cache (~/.cache/torch_extensions, or
    $TORCH_EXTENSIONS_DIR), silently, under a lock file that a killed build leaves behind and that
    every later build waits on for ever. So the local main process clears a stale lock first (or
    says why it waits), says when it compiles and how long it took, and builds while the other local
    ranks wait for the result; a SIGTERM during the build ends it as an exception, so that torch
    releases its lock.
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    # Where torch's load() builds, and so holds its lock: private, with no public counterpart (test_faults
    # fails if it changes).
    from torch.utils.cpp_extension import _get_build_directory

    local_main = int(os.environ.get("LOCAL_RANK", "0")) == 0
    seconds = {}
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            continue  # DeepSpeed does without it on this machine
        build_dir = _get_build_directory(builder.name, verbose=False)
        library = os.path.join(build_dir, f"{builder.name}.so")
        compiling = not installed_ops.get(builder.name) and not os.path.exists(library)
        if local_main:
            release_stale_build_lock(build_dir)
            if compiling:
                print(f"compiling DeepSpeed's {builder.name} op for this machine (first use only; it took "
                      f"{COMPILE_SECONDS[name]} s on a 2-core CPU; later launches load it from {build_dir})",
                      flush=True)
        elif compiling:
            while not os.path.exists(library):  # the local main process builds it; the launcher stops us if it fails
                time.sleep(0.5)
        start = time.perf_counter()
        with sigterm_raises():
            builder.load(verbose=False)
        seconds[builder.name] = time.perf_counter() - start
        if compiling and local_main:
            print(f"compiled {builder.name} in {seconds[builder.name]:.0f} s", flush=True)
    return seconds


@contextmanager
def sigterm_raises():
    """SIGTERM as SystemExit (exit code 143) meanwhile, so that `finally` blocks run (torch's build releases
    its lock file in one) instead of the process vanishing."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def release_stale_build_lock(build_dir: str) -> None:
    """Remove the `lock` a killed build left in a torch extension's build folder, when provably stale.

    While torch builds, the process that took the lock (its FileBaton) keeps it open: a lock that no
    process on this machine holds open was left by a build that died. Compilers it started may still
    work in the folder (a rank killed outright leaves them running): those are waited for. Then, a
    second later and still unheld, the lock is removed, unless the folder is on a file system other
    machines may share, where a build elsewhere could hold it: that is only reported, with what to do.
    """
    lock = os.path.join(build_dir, "lock")

    def processes(test) -> list[str]:
        found = []
        for process in psutil.process_iter(["name"]):
            try:
                if test(process):
                    found.append(f"pid {process.pid} ({process.info['name']})")
            except (psutil.Error, OSError):
                continue  # gone, or another user's: it cannot build in this user's cache
        return found

    def holding():
        return processes(lambda p: any(f.path == lock for f in p.open_files()))

    def working():
        return processes(lambda p: os.path.join(p.cwd(), "").startswith(os.path.join(build_dir, "")))

    def identity():
        try:
            stat = os.stat(lock)
            return stat.st_ino, stat.st_mtime_ns
        except FileNotFoundError:
            return None

    first = identity()
    if first is None:
        return
    if holding():
        print(f"waiting for {', '.join(holding())}, compiling in {build_dir}", flush=True)
        return
    if working():
        print(f"waiting for {', '.join(working())}, left compiling in {build_dir} by a build that was killed",
              flush=True)
        while working():
            time.sleep(1)
    file_system = file_system_type(build_dir)
    if file_system in SHARED_FILE_SYSTEMS or file_system.startswith("fuse."):
        print(f"warning: waiting for {lock}: no process on this machine is compiling there, and another machine "
              f"sharing this file system ({file_system}) may be. If none is, a killed build left it: stop this "
              f"launch, delete it (rm {lock}) and launch again", file=sys.stderr, flush=True)
        return
    time.sleep(1)
    if identity() != first or holding() or working():
        return
    os.remove(lock)
    print(f"removed {lock}: a build that no longer runs left it (this launch would have waited on it for ever)",
          flush=True)


def file_system_type(path: str) -> str:
    path = os.path.realpath(path)
    mounts = [p for p in psutil.disk_partitions(all=True) if path == p.mountpoint or
              path.startswith(os.path.join(p.mountpoint, ""))]
    return max(mounts, key=lambda p: len(p.mountpoint)).fstype if mounts else ""
