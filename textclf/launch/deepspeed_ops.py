"""DeepSpeed's C++ ops, compiled at first use: loaded (or built) with a word about it, and a build lock that a killed
build left behind released when provably stale. Used by a launch that needs an op (DeepSpeed on a CPU, optimizer
offload) and by scripts/warm_deepspeed_ops.py; deepspeed itself is imported only then.
"""

import os
import signal
import sys
import time
from contextlib import contextmanager

import psutil

from .launcher import launch_environment

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

    local_main = launch_environment().local_rank == 0
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
    first = file_identity(lock)
    if first is None:
        return
    if holders := holding(lock):
        print(f"waiting for {', '.join(holders)}, compiling in {build_dir}", flush=True)
        return
    if working(build_dir):
        print(f"waiting for {', '.join(working(build_dir))}, left compiling in {build_dir} by a build that was "
              "killed", flush=True)
        while working(build_dir):
            time.sleep(1)
    file_system = file_system_type(build_dir)
    if file_system in SHARED_FILE_SYSTEMS or file_system.startswith("fuse."):
        print(f"warning: waiting for {lock}: no process on this machine is compiling there, and another machine "
              f"sharing this file system ({file_system}) may be. If none is, a killed build left it: stop this "
              f"launch, delete it (rm {lock}) and launch again", file=sys.stderr, flush=True)
        return
    time.sleep(1)
    if file_identity(lock) != first or holding(lock) or working(build_dir):
        return
    os.remove(lock)
    print(f"removed {lock}: a build that no longer runs left it (this launch would have waited on it for ever)",
          flush=True)


def processes(test) -> list[str]:
    """This machine's processes for which test(process) holds, as "pid N (name)"."""
    found = []
    for process in psutil.process_iter(["name"]):
        try:
            if test(process):
                found.append(f"pid {process.pid} ({process.info['name']})")
        except (psutil.Error, OSError):
            continue  # gone, or another user's: it cannot build in this user's cache
    return found


def holding(lock: str) -> list[str]:
    return processes(lambda p: any(f.path == lock for f in p.open_files()))


def working(build_dir: str) -> list[str]:
    return processes(lambda p: os.path.join(p.cwd(), "").startswith(os.path.join(build_dir, "")))


def file_identity(path: str):
    try:
        stat = os.stat(path)
        return stat.st_ino, stat.st_mtime_ns
    except FileNotFoundError:
        return None


def file_system_type(path: str) -> str:
    path = os.path.realpath(path)
    mounts = [p for p in psutil.disk_partitions(all=True) if path == p.mountpoint or
              path.startswith(os.path.join(p.mountpoint, ""))]
    return max(mounts, key=lambda p: len(p.mountpoint)).fstype if mounts else ""
