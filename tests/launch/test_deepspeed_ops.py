"""DeepSpeed's C++ ops compiled at first use (textclf/launch/deepspeed_ops.py): the build lock torch takes, a dead
build's lock released."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY, run_train


@pytest.fixture(scope="module")
def args(reviews_csv, cache_dir):
    return [*TINY, "--data", reviews_csv, "--cache_dir", cache_dir]


def hold_like_a_build(lock: Path) -> subprocess.Popen:
    """A process holding `lock` the way torch's extension build does while it compiles (its FileBaton)."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from torch.utils.file_baton import FileBaton; "
                               "assert FileBaton(sys.argv[1]).try_acquire(); print('held', flush=True); "
                               "time.sleep(600)",
                               str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_the_build_folder_deepspeed_ops_looks_in_is_where_torch_takes_its_lock(tmp_path, monkeypatch):
    """deepspeed_ops.load_deepspeed_ops finds the lock through torch's private _get_build_directory: the folder
    where torch's load() (DeepSpeed's jit_load) builds unless told another, with its lock file inside."""
    import inspect

    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpp_extension._get_build_directory("cpu_adam", verbose=False) == str(tmp_path / "cpu_adam")
    assert "build_directory or _get_build_directory(name, verbose)" in inspect.getsource(cpp_extension.load)
    assert "FileBaton(os.path.join(build_directory, 'lock'))" in inspect.getsource(cpp_extension._jit_compile)


def test_a_build_lock_held_by_a_live_build_is_left_one_that_died_is_removed_once_its_compilers_end(
        tmp_path, capsys):
    from textclf.launch.deepspeed_ops import release_stale_build_lock

    lock = tmp_path / "lock"
    holder = hold_like_a_build(lock)
    try:
        release_stale_build_lock(str(tmp_path))
        assert lock.exists() and f"waiting for pid {holder.pid}" in capsys.readouterr().out
    finally:
        holder.kill()  # killed mid-build: the lock stays, and a compiler it started works on in the folder
        holder.wait()
    compiler = subprocess.Popen(["sleep", "3"], cwd=tmp_path)
    release_stale_build_lock(str(tmp_path))
    output = capsys.readouterr().out
    assert compiler.poll() is not None, "the lock was released while a compiler still worked in the folder"
    assert f"waiting for pid {compiler.pid} (sleep), left compiling in {tmp_path} by a build that was killed" in output
    assert not lock.exists() and f"removed {lock}: a build that no longer runs left it" in output


@pytest.mark.slow
def test_the_first_deepspeed_launch_clears_a_dead_builds_lock_and_says_it_compiles(tmp_path, args):
    from torch.utils import cpp_extension

    extensions = tmp_path / "torch_extensions"  # a cache of its own, without the comm op's library
    # With the objects that warming the cache compiled (scripts/warm_deepspeed_ops.py), torch's build only links
    # the library again where this environment compiled them (else it compiles them again): what is tested is the
    # stale lock and what the launch says, not the compiler.
    warm = Path(cpp_extension._get_build_directory("deepspeed_shm_comm", verbose=False))
    if warm.is_dir():
        shutil.copytree(warm, extensions / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("*.so", "lock"))
    (extensions / "deepspeed_shm_comm").mkdir(parents=True, exist_ok=True)
    (extensions / "deepspeed_shm_comm" / "lock").write_text("")  # left by a build that was killed
    result = run_train([*args, "--max_steps", 1, "--output_dir", tmp_path / "out"],
                       config_file=REPO / "accelerate_configs" / "zero2.yaml",
                       env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    lock = extensions / "deepspeed_shm_comm" / "lock"
    assert result.stdout.count(f"removed {lock}: a build that no longer runs left it") == 1
    assert result.stdout.count("compiling DeepSpeed's deepspeed_shm_comm op for this machine (first use only") == 1
    assert re.search(r"^compiled deepspeed_shm_comm in \d+ s$", result.stdout, re.MULTILINE)
    assert (extensions / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").exists() and not lock.exists()
