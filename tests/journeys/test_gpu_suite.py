"""scripts/gpu_suite.py, the GPU suite's runner, and the wheels it brings along."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = [sys.executable, "scripts/gpu_suite.py"]


def suite(*args, check=True):
    result = subprocess.run([*SCRIPT, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_plan_runs_the_gpu_tests_in_parallel_groups_then_the_named_benchmark():
    plan = json.loads(suite("--dry_run", "--no_install", "--workers", 4, "--pytest_args", "-k zero3",
                            "--bench_module", "benchmarks", "--bench_args", "--only single --repeats 2").stdout)
    tests = plan["tests"]
    assert tests[tests.index("-m") + 1:tests.index("-m") + 3] == ["pytest", "tests/journeys/test_gpu.py"]
    assert ["-m", "gpu"] == tests[tests.index("gpu") - 1:tests.index("gpu") + 1]
    assert tests[tests.index("-n"):tests.index("-n") + 4] == ["-n", "4", "--dist", "loadgroup"]
    assert tests[-2:] == ["-k", "zero3"]
    assert plan["bench"][1:] == ["-m", "benchmarks", "--only", "single", "--repeats", "2"]
    assert plan["install"] is None and plan["budget_s"] == 570


def test_the_steady_state_measurement_is_one_command_that_runs_the_benchmark_alone():
    plan = json.loads(suite("--dry_run", "--no_install", "--no_tests", "--bench_module", "benchmarks.steady",
                            "--bench_args=").stdout)
    assert plan["tests"] is None and plan["warm"] is None and plan["bench_reserve_s"] == 0
    assert plan["bench"][1:] == ["-m", "benchmarks.steady"]


def test_the_install_takes_every_wheel_brought_along(tmp_path):
    for name in ("b-1.0-py3-none-any.whl", "a-2.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    install = json.loads(suite("--dry_run", "--wheels", tmp_path, "--site", tmp_path / "site").stdout)["install"]
    assert install[install.index("--target") + 1] == str(tmp_path / "site")
    assert "--no-index" in install and "--no-deps" in install
    assert install[-2:] == [str(tmp_path / "a-2.0-py3-none-any.whl"), str(tmp_path / "b-1.0-py3-none-any.whl")]


@pytest.mark.parametrize("args, message", [
    (["--budget", 40], "--budget 40 leaves no time to run anything"),
    (["--budget", 300, "--bench_reserve", 290], "--bench_reserve 290 must leave time for the tests"),
    (["--wheels", "no_such_folder"], "no wheels in no_such_folder: fetch them with scripts/gpu_wheels.sh"),
    (["--workers", -1], "--workers must be 0"),
    (["--no_tests", "--no_bench"], "--no_tests and --no_bench leave nothing to run"),
])
def test_arguments_that_cannot_work_are_refused_before_anything_runs(args, message):
    result = suite(*args, check=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_the_wheel_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", "scripts/gpu_wheels.sh"], cwd=REPO).returncode == 0


def test_the_wheels_come_from_the_projects_own_dependencies_less_the_gpu_image():
    from importlib.metadata import version

    plan = subprocess.run(["bash", "scripts/gpu_wheels.sh", "--plan"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})  # offline: no pip
    assert plan.returncode == 0, plan.stderr
    wheels = dict(line.split() for line in plan.stdout.splitlines())
    # The project's packages that the image lacks, each at the version the CPU tests ran, and what they need.
    for name in ("datasets", "evaluate", "deepspeed", "snownlp", "dill", "multiprocess", "hjson", "pydantic",
                 "pydantic-core"):
        assert wheels[name] == version(name), name
    assert wheels["liger-kernel"] == "-" or wheels["liger-kernel"] == version("liger-kernel")  # the GPU extra
    # No longer a dependency, or the image's own: never brought along.
    for name in ("torch", "triton", "transformers", "accelerate", "peft", "numpy", "typing-extensions"):
        assert name not in wheels, name


@pytest.mark.slow
def test_without_cuda_the_report_shows_every_gpu_test_skipped_with_its_reason(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the suite would really run (tests/journeys/test_gpu.py)")
    report = tmp_path / "report.md"
    # No xdist workers: on a machine without CUDA each of the default 6 would import torch only to skip its tests
    # (the plan's workers are test_the_plan_runs_the_gpu_tests_in_parallel_groups_then_the_named_benchmark's).
    suite("--no_install", "--no_bench", "--budget", 300, "--workers", 0, "--report", report,
          "--work_dir", tmp_path / "work")
    text = report.read_text(encoding="utf-8")
    gpu_tests = "tests/journeys/test_gpu.py"
    collected = subprocess.run([sys.executable, "-m", "pytest", "--full", "--collect-only", "-q", gpu_tests],
                               cwd=REPO, capture_output=True, text=True).stdout.count(f"{gpu_tests}::")
    assert collected > 30 and f"**Tests: {collected} skipped.**" in text
    assert text.count("| skipped | ") == collected and "needs a CUDA GPU, which this machine lacks" in text
    assert "- cuda_available: False" in text and "| torch | " in text and "| tests | exit 0 |" in text
    assert "## Benchmark" in text and "Not run" in text


@pytest.mark.slow
def test_loadgroup_keeps_each_group_on_one_worker(tmp_path):
    """The GPU suite's `--dist loadgroup`: the runs a group's tests compare share one worker (conftest's
    keep_groups_together, for pytest 9, where pytest-xdist's own grouping is lost)."""
    (tmp_path / "conftest.py").write_text(
        "import importlib.util, sys\n"
        f"sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]\n"
        f"spec = importlib.util.spec_from_file_location('project_conftest', {str(REPO / 'tests' / 'conftest.py')!r})\n"
        "project = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(project)\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    project.keep_groups_together(config, items)\n", encoding="utf-8")
    # Marked as test_gpu.py marks its runs: a group on each parameter.
    (tmp_path / "test_groups.py").write_text(
        "import os, pytest\n"
        "@pytest.mark.parametrize('n', [pytest.param(n, marks=pytest.mark.xdist_group('a' if n // 2 % 2 else 'b'))\n"
        "                               for n in range(16)])\n"
        "def test_member(n):\n"
        "    with open(os.environ['GROUPS_OUT'], 'a') as f:\n"
        "        f.write(('a' if n // 2 % 2 else 'b') + ' ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n",
        encoding="utf-8")
    out = tmp_path / "groups.txt"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                             "loadgroup", "test_groups.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "GROUPS_OUT": str(out)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    workers = {}
    for line in out.read_text().splitlines():
        group, worker = line.split()
        workers.setdefault(group, set()).add(worker)
    assert sorted(workers) == ["a", "b"] and all(len(ran_on) == 1 for ran_on in workers.values()), workers
