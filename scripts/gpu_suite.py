"""Prepare a bare CUDA machine, run the GPU test suite and the benchmark, and write one report, all within
one command's time budget (570 s by default: `--budget`). Uses the standard library only:
it runs before the project's packages are installed.

    python3 scripts/gpu_suite.py                            # wheels from .whl/, report in $OUT or here
    python3 scripts/gpu_suite.py --budget 570 --bench_args "--quick"
    python3 scripts/gpu_suite.py --dry_run                  # the plan, nothing run
    python3 scripts/gpu_suite.py --no_tests --bench_module benchmarks.steady --bench_args=   # steady state only

Steps, each under its share of the budget (a step that runs out is stopped, and the report says so):
1. install the wheels that scripts/gpu_wheels.sh fetched (the machine has torch but not the rest, and
   no network): `pip install --no-index --no-deps --target SITE`, SITE first on PYTHONPATH;
2. the environment: GPU, driver, CUDA, and the version of every package the project uses;
3. DeepSpeed's CPU Adam (the offload files use it on GPUs too), built once before the tests;
4. tests/journeys/test_gpu.py (pytest, in parallel over --workers when pytest-xdist is there), with the
   measurements the tests record (resume gaps, loss scale, syncs per step, the default job);
5. the benchmark (`python -m <bench_module> <bench_args>`) in the time left, its tables in the report.
The report is one markdown file; raw logs stay in --work_dir.
"""

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The benchmark's module (`python -m benchmarks`), in one place.
BENCH_MODULE = os.environ.get("TEXTCLF_BENCH_MODULE", "benchmarks")
# Packages whose versions the report gives, and where each came from (the wheels brought along, or the machine's own).
PACKAGES = ("torch", "accelerate", "transformers", "tokenizers", "datasets", "deepspeed", "liger-kernel", "peft",
            "safetensors", "huggingface-hub", "pyarrow", "fsspec", "numpy", "pydantic", "snownlp", "pytest",
            "pytest-xdist", "pytest-timeout")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
REPORT_RESERVE_S = 15  # kept for writing the report after the last step


def parse_args(argv=None) -> argparse.Namespace:
    out = os.environ.get("OUT")
    parser = argparse.ArgumentParser(prog="python3 scripts/gpu_suite.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", default=".whl", help="folder of wheels to install (scripts/gpu_wheels.sh)")
    parser.add_argument("--no_install", action="store_true", help="use the packages already installed")
    parser.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "textclf-site"),
                        help="where the wheels are installed (put first on PYTHONPATH)")
    parser.add_argument("--report", default=os.path.join(out, "gpu_report.md") if out else "gpu_report.md",
                        help="the report to write (default: $OUT/gpu_report.md, or ./gpu_report.md)")
    parser.add_argument("--work_dir", default=None, help="raw logs, junit XML, the benchmark's files (default: a "
                                                         "temporary folder, kept)")
    parser.add_argument("--budget", type=float, default=570, help="seconds for everything (default 570: a "
                                                                  "600-second command with room to return)")
    parser.add_argument("--bench_reserve", type=float, default=200,
                        help="seconds kept for the benchmark; the tests get the rest")
    parser.add_argument("--bench_module", default=BENCH_MODULE, help=f"the benchmark's module (default {BENCH_MODULE})")
    parser.add_argument("--bench_args", default="--quick", help="arguments of the benchmark (default --quick)")
    parser.add_argument("--no_bench", action="store_true", help="run the tests only")
    parser.add_argument("--no_tests", action="store_true", help="run the benchmark only (it gets the whole budget)")
    parser.add_argument("--workers", type=int, default=None,
                        help="pytest-xdist workers (default: 6 when pytest-xdist is installed, else none)")
    parser.add_argument("--test_timeout", type=int, default=300, help="seconds one test may take (pytest-timeout)")
    parser.add_argument("--pytest_args", default="", help="more pytest arguments, e.g. \"-k zero3\"")
    parser.add_argument("--dry_run", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)
    if args.budget <= REPORT_RESERVE_S + 30:
        parser.error(f"--budget {args.budget:g} leaves no time to run anything (at least {REPORT_RESERVE_S + 30} s)")
    if args.no_tests and args.no_bench:
        parser.error("--no_tests and --no_bench leave nothing to run")
    if args.no_tests:
        args.bench_reserve = 0  # nothing else to keep the time from
    if args.bench_reserve < 0 or (not args.no_bench and args.bench_reserve >= args.budget - REPORT_RESERVE_S):
        parser.error(f"--bench_reserve {args.bench_reserve:g} must leave time for the tests within --budget "
                     f"{args.budget:g}")
    if args.workers is not None and args.workers < 0:
        parser.error("--workers must be 0 (no xdist) or more")
    if not args.no_install and not args.dry_run and not sorted(Path(args.wheels).glob("*.whl")):
        parser.error(f"no wheels in {args.wheels}: fetch them with scripts/gpu_wheels.sh where PyPI is reachable, "
                     "or pass --no_install")
    return args


class Clock:
    """The deadline of the whole command, and what each step may still take."""

    def __init__(self, budget: float):
        self.start = time.monotonic()
        self.deadline = self.start + budget

    def left(self, keep: float = 0.0) -> float:
        return max(0.0, self.deadline - time.monotonic() - REPORT_RESERVE_S - keep)

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def run(command: list[str], log: Path, timeout: float, env: dict) -> dict:
    """Run a command in its own session, its output into `log`; stop it and all its children at the timeout."""
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=max(timeout, 1))
            timed_out = False
        except subprocess.TimeoutExpired:
            code, timed_out = None, True
        finally:  # timed out, or this script stopped (SIGTERM, Ctrl-C): the command's group stops too
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # training ranks die with their launcher (die_with_launcher)
                code = process.wait()
    return {"command": " ".join(shlex.quote(c) for c in command), "exit_code": code, "timed_out": timed_out,
            "seconds": round(time.monotonic() - start, 1), "log": str(log), "timeout": round(timeout)}


def tail(path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def python_has(module: str, env: dict) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True).returncode == 0


def install_command(args) -> list:
    if args.no_install:
        return None
    return [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
            "--upgrade", "--target", args.site, *map(str, sorted(Path(args.wheels).glob("*.whl")))]


def plan(args, env: dict) -> dict:
    """The commands of the steps after the install (pytest's plugins may come with the wheels)."""
    xdist = python_has("xdist", env)
    workers = args.workers if args.workers is not None else (6 if xdist else 0)
    pytest = [sys.executable, "-m", "pytest", "tests/journeys/test_gpu.py", "-m", "gpu", "-v", "-rA", "-p",
              "no:cacheprovider", "--durations=0"]
    if workers:
        pytest += ["-n", str(workers), "--dist", "loadgroup"]
    if python_has("pytest_timeout", env):
        pytest += ["--timeout", str(args.test_timeout)]
    pytest += shlex.split(args.pytest_args)
    return {
        "warm": None if args.no_tests else [sys.executable, "scripts/warm_deepspeed_ops.py"],
        "tests": None if args.no_tests else pytest,
        "bench": None if args.no_bench else [sys.executable, "-m", args.bench_module, *shlex.split(args.bench_args)],
        "workers": workers,
    }


ENVIRONMENT = r"""
import importlib.metadata, json, os, platform, sys
facts = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
try:
    import torch
    facts.update(cuda_available=torch.cuda.is_available(), torch_cuda=torch.version.cuda,
                 cudnn=torch.backends.cudnn.version() if torch.cuda.is_available() else None,
                 gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                 bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported())
except Exception as e:
    facts["torch_error"] = repr(e)
site = sys.argv[1]
versions = {}
for name in sys.argv[2:]:
    try:
        dist = importlib.metadata.distribution(name)
        versions[name] = [dist.version, "brought" if site and str(dist.locate_file("")).startswith(site) else "machine"]
    except importlib.metadata.PackageNotFoundError:
        versions[name] = [None, "missing"]
facts["versions"] = versions
print(json.dumps(facts))
"""


def environment(site: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", ENVIRONMENT, site, *PACKAGES], env=env, capture_output=True,
                          text=True, timeout=120)
    facts = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-2000:]}
    smi = shutil.which("nvidia-smi")
    if smi:
        query = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
        facts["nvidia_smi"] = query.stdout.strip() or query.stderr.strip()
    # The wheels were installed without their dependencies: pip says which requirement the machine misses.
    check = subprocess.run([sys.executable, "-m", "pip", "check"], env=env, capture_output=True, text=True, timeout=120)
    facts["pip_check"] = (check.stdout + check.stderr).strip()
    return facts


OUTCOME = re.compile(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(tests/\S+)"
                     r"|(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED)")


def test_outcomes(log: Path, junit: Path) -> list[dict]:
    """Each test's outcome: from the junit XML when pytest finished, else from its verbose log."""
    if junit.is_file():
        rows = []
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            outcome, detail = "passed", ""
            for kind in ("failure", "error", "skipped"):
                found = case.find(kind)
                if found is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                    detail = (found.get("message") or "").strip()
                    if kind != "skipped":
                        detail = ((found.text or "").strip().splitlines() or [detail])[-1]
            rows.append({"test": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}",
                         "outcome": outcome, "seconds": float(case.get("time", 0)), "detail": detail})
        return rows
    seen = {}
    for line in Path(log).read_text(encoding="utf-8", errors="replace").splitlines() if log.is_file() else []:
        match = OUTCOME.search(line)
        if match:
            outcome, test = (match.group(1), match.group(2)) if match.group(1) else (match.group(4), match.group(3))
            seen[test.split("/")[-1]] = {"test": test.split("/")[-1], "outcome": outcome.lower(), "seconds": None,
                                         "detail": ""}
    return list(seen.values())


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def outcome_line(row: dict) -> str:
    seconds = "" if row["seconds"] is None else f"{row['seconds']:.0f}"
    return f"| {row['test']} | {row['outcome']} | {seconds} | {row['detail'][:200].replace('|', '/')} |"


def step_line(name: str, step) -> str:
    if step is None:
        return f"| {name} | not run | | |"
    state = "stopped at its time limit" if step["timed_out"] else f"exit {step['exit_code']}"
    return f"| {name} | {state} | {step['seconds']} s of {step['timeout']} | `{step['command'][:150]}` |"


def write_report(path: Path, args, facts: dict, steps: dict, outcomes: list[dict], records: list[dict],
                 bench_md: str, clock: Clock, work: Path) -> None:
    counts = {}
    for row in outcomes:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or (
        "no test outcome" if steps.get("tests") else "not run (--no_tests)")
    lines = [f"# GPU suite: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}", "",
             f"`python3 scripts/gpu_suite.py {' '.join(sys.argv[1:])}`".replace("``", "`(no arguments)`"),
             f"in {clock.elapsed():.0f} s of a {args.budget:g}-second budget. **Tests: {summary}.**", "",
             "## Environment", ""]
    if facts.get("nvidia_smi"):
        lines.append(f"- nvidia-smi: {facts['nvidia_smi']}")
    for key in ("gpus", "cuda_available", "bf16", "torch_cuda", "cudnn", "python", "platform", "cpus", "torch_error",
                "error"):
        if key in facts:
            lines.append(f"- {key}: {facts[key]}")
    versions = facts.get("versions", {})
    lines += ["", "| package | version | from |", "|---|---|---|",
              *(f"| {name} | {version or '-'} | {origin} |" for name, (version, origin) in versions.items()), "",
              "`pip check`:", "", "```", "\n".join(facts.get("pip_check", "").splitlines()[:25]), "```", "",
              "## Steps", "", "| step | result | time | command |", "|---|---|---|---|",
              *(step_line(name, steps.get(name)) for name in ("install", "warm", "tests", "bench")), ""]
    lines += ["## Tests", "", f"{summary}; pytest with {steps.get('workers') or 'no'} xdist workers.", "",
              "| test | outcome | s | detail |", "|---|---|---|---|",
              *(outcome_line(r) for r in outcomes), ""]
    failing = [r for r in outcomes if r["outcome"] in ("failed", "error")]
    tests = steps.get("tests")
    if failing or (tests and (tests["timed_out"] or tests["exit_code"] not in (0, 5))):
        lines += ["Tail of the pytest log:", "", "```", tail(work / "pytest.log", 80), "```", ""]
    if records:
        lines += ["## Measured by the tests", "", "| test | measurements |", "|---|---|",
                  *(f"| {r.pop('test')} | {json.dumps(r, ensure_ascii=False)} |" for r in records), ""]
    lines += ["## Benchmark", ""]
    bench = steps.get("bench")
    if bench is None:
        lines += ["Not run (--no_bench, or no time left).", ""]
    elif bench_md:
        lines += [re.sub(r"^#", "###", bench_md, flags=re.M), ""]
    else:
        lines += ["No bench.md was written. Tail of its log:", "", "```", tail(bench["log"], 40), "```", ""]
    lines += [f"Raw logs: {work} (on the machine that ran it).", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")


def main(argv=None) -> int:
    args = parse_args(argv)
    clock = Clock(args.budget)
    env = {**os.environ, **OFFLINE}
    if not args.no_install:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(args.site).resolve()), env.get("PYTHONPATH")]))
    install = install_command(args)
    if args.dry_run:
        print(json.dumps({"budget_s": args.budget, "bench_reserve_s": 0 if args.no_bench else args.bench_reserve,
                          "report": args.report, "install": install, **plan(args, env)}, indent=1))
        return 0
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-suite-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    bench_keep = 0 if args.no_bench else args.bench_reserve
    done = {}
    if install:
        shutil.rmtree(args.site, ignore_errors=True)
        done["install"] = run(install, work / "install.log", min(120, clock.left(bench_keep)), env)
    steps = plan(args, env)
    done["workers"] = steps["workers"]
    facts = environment(str(Path(args.site).resolve()) if not args.no_install else "", env)
    cuda = facts.get("cuda_available")
    if cuda and steps["warm"]:  # the CPU Adam build the offload files need (without CUDA the tests skip anyway)
        done["warm"] = run(steps["warm"], work / "warm.log", min(180, clock.left(bench_keep)), env)
    results = work / "results.jsonl"
    results.unlink(missing_ok=True)
    junit = work / "junit.xml"
    # Parallel workers each launch trainings: share the cores out rather than give each process all of them.
    threads = str(max(1, (os.cpu_count() or 1) // max(steps["workers"], 1)))
    if steps["tests"]:
        done["tests"] = run([*steps["tests"], "--junitxml", str(junit)], work / "pytest.log", clock.left(bench_keep),
                            {"OMP_NUM_THREADS": threads, **env, "GPU_SUITE_RESULTS": str(results)})
    bench_md = ""
    if steps["bench"] and clock.left() > 30:
        bench_dir = work / "bench"
        done["bench"] = run([*steps["bench"], "--output_dir", str(bench_dir)], work / "bench.log", clock.left(), env)
        written = [bench_dir / name for name in ("bench.md", "steady.md") if (bench_dir / name).is_file()]
        bench_md = written[0].read_text(encoding="utf-8") if written else ""  # benchmarks', or benchmarks.steady's
    write_report(Path(args.report), args, facts, done, test_outcomes(work / "pytest.log", junit),
                 read_records(results), bench_md, clock, work)
    print(f"report: {args.report} ({clock.elapsed():.0f} s); raw logs: {work}")
    tests = done.get("tests") or done.get("bench")
    return 0 if tests and not tests["timed_out"] and tests["exit_code"] in (0, 5) else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that the running command is stopped too
    sys.exit(main())
