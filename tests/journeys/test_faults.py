"""Faults as users meet them, launched for real: two runs in one folder, --overwrite_output_dir, kills, full disks,
signals and stopped launches, links planted where a run writes, a requeued job's script."""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import (
    CPU_YAML,
    OFFLINE,
    REPO,
    TINY,
    MiB,
    assert_refused,
    free_port,
    full_disk,
    losses,
    read_log,
    run_train,
    train_command,
    untouched,
    wait_for,
)


@pytest.fixture(scope="module")
def args(reviews_csv, cache_dir):
    return [*TINY, "--data", reviews_csv, "--cache_dir", cache_dir]


def launch(command, **kwargs) -> subprocess.Popen:
    """Start a command in a session of its own (as a terminal would), output merged, lines collected: split at
    "\n" alone, as a terminal shows them (a progress bar redraws its line after a "\r")."""
    process = subprocess.Popen(command, cwd=REPO, start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE}, **kwargs)
    process.lines = []
    output = io.TextIOWrapper(process.stdout, encoding="utf-8", errors="replace", newline="\n")
    reader = threading.Thread(target=lambda: process.lines.extend(output), daemon=True)
    reader.start()
    process.reader = reader
    return process


def finish(process, timeout=900) -> str:
    process.wait(timeout=timeout)
    process.reader.join(timeout=60)
    return "".join(process.lines)


def wait_until(condition, what, timeout=600):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def run_limited(command, limit) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, **OFFLINE},
                          preexec_fn=limit, timeout=900)


# torch logs its file's path relative to the working directory when it can: a virtual environment
# inside the repository (.venv, as CI has it) puts one before torch/.
TORCHRUN_LOG_LINE = re.compile(r"^[WEI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ (\S+/)?torch/distributed/")


def descendants(process) -> list[psutil.Process]:
    try:
        return psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def ranks_of(process, module) -> list[psutil.Process]:
    found = []
    for child in descendants(process):
        try:
            if module in " ".join(child.cmdline()) and "RANK" in child.environ():
                found.append(child)
        except psutil.Error:
            continue
    return found


def all_gone(processes) -> bool:
    return not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def stop(process, how):
    """Stop a launch as a user or a scheduler would: the launcher's pid gets SIGTERM or SIGINT, or the
    `timeout` wrapping it fires (SIGALRM is its timer: it then sends SIGTERM to the launch's group)."""
    os.kill(process.pid, {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "timeout": signal.SIGALRM}[how])


@pytest.fixture(scope="module")
def many_reviews(tmp_path_factory, corpus_csv) -> Path:
    """The corpus 3 times over: a prediction that is still running when it is stopped."""
    path = tmp_path_factory.mktemp("many") / "many.csv"
    lines = corpus_csv.read_text(encoding="utf-8").splitlines(keepends=True)
    path.write_text(lines[0] + "".join(lines[1:] * 3), encoding="utf-8")
    return path


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


@pytest.mark.slow
@pytest.mark.parametrize("config_file", [None, CPU_YAML], ids=["one-process", "cpu.yaml"])
def test_two_runs_started_together_one_owns_the_folder_and_the_other_says_which_process(
        tmp_path, args, config_file, four_step_run):
    # The first run is held still (SIGSTOP, every process of its launch) once it owns the folder and has
    # logged a step, so that the second arrives while it runs however loaded the machine is.
    out = tmp_path / "contested"
    run = [*args, "--max_steps", 60, "--save_steps", 20, "--output_dir", out]
    first = launch(train_command(run, config_file))
    wait_until(lambda: (out / ".lock").exists() and (out / ".lock").read_text() and (out / "log.jsonl").exists()
               and "\n" in (out / "log.jsonl").read_text(), "the first run owns the folder and has logged a step")
    held = [psutil.Process(first.pid), *descendants(first)]
    for process in held:
        process.suspend()
    try:
        second = run_train(run, config_file=config_file, check=False)
    finally:
        for process in held:
            process.resume()
    output = finish(first)
    assert first.returncode == 0, output[-3000:]
    holder = (out / ".lock").read_text().strip()  # the first run's main process: pid, host, start, command
    errors = error_lines(second.stderr)
    assert second.returncode != 0 and len(errors) == 1, second.stderr[-3000:]
    assert f"{out} is in use by another run ({holder})" in errors[0], second.stderr[-3000:]
    assert re.match(r"pid \d+ on \S+, since ", holder)
    # The folder holds one run: every step logged once, checkpoints made by that run, its model.
    assert sorted(losses(out)) == list(range(1, 61))
    assert sorted(name for name in os.listdir(out) if name.startswith("step_")) == ["step_20", "step_40", "step_60"]
    assert (out / "model" / "model.safetensors").exists()
    # Its lock went with it: the folder is free again, and resume finds the run's last checkpoint.
    result = run_train([*run, "--resume", "latest"], config_file=config_file)
    assert f"resumed from {out / 'step_60'} at optimizer step 60" in result.stdout


@pytest.mark.slow
def test_overwrite_output_dir_moves_the_old_run_aside_and_resume_latest_continues_the_new_one(
        tmp_path, args, four_step_run):
    out = tmp_path / "run"
    shutil.copytree(four_step_run, out)  # the old run: step_2, step_4, lr 1e-3
    new = [*args, "--learning_rate", "5e-4", "--max_steps", 3, "--save_steps", 3, "--output_dir", out]
    result = run_train([*new, "--overwrite_output_dir"])
    aside = [path for path in tmp_path.iterdir() if path.name.startswith("run.replaced-")]
    assert len(aside) == 1 and f"moved the previous run in {out} aside to {aside[0]}" in result.stdout
    assert sorted(os.listdir(aside[0])) == sorted(os.listdir(four_step_run))  # the old run, whole
    assert sorted(name for name in os.listdir(out) if name.startswith("step_")) == ["step_3"]
    assert sorted(losses(out)) == [1, 2, 3]
    resumed = run_train([*new[:-4], "--max_steps", 5, "--save_steps", 5, "--output_dir", out, "--resume", "latest"])
    assert f"resumed from {out / 'step_3'} at optimizer step 3" in resumed.stdout
    assert json.loads((out / "run.json").read_text())["config"]["learning_rate"] == 5e-4
    assert sorted(losses(out)) == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_overwrite_with_resume_latest_is_refused(tmp_path, args, four_step_run):
    out = shutil.copytree(four_step_run, tmp_path / "run")
    result = run_train([*args, "--max_steps", 4, "--output_dir", out, "--resume", "latest", "--overwrite_output_dir"],
                       check=False)
    assert_refused(result, "drop one of them")
    assert sorted(os.listdir(out)) == sorted(os.listdir(four_step_run))


@pytest.mark.slow
def test_overwrite_with_resume_of_an_earlier_checkpoint_moves_only_the_later_ones_aside(tmp_path, args, four_step_run):
    out = shutil.copytree(four_step_run, tmp_path / "run")
    resume = [*args, "--max_steps", 4, "--output_dir", out, "--resume", out / "step_2"]
    assert_refused(run_train(resume, check=False), "holds checkpoints after it (step_4)")
    assert sorted(os.listdir(out)) == sorted(os.listdir(four_step_run))
    result = run_train([*resume, "--overwrite_output_dir"])
    aside = [path for path in tmp_path.iterdir() if path.name.startswith("run.replaced-")]
    assert len(aside) == 1 and os.listdir(aside[0]) == ["step_4"], result.stdout
    assert f"moved step_4 of {out} aside to {aside[0]}" in result.stdout
    assert sorted(name for name in os.listdir(out) if name.startswith("step_")) == ["step_2", "step_4"]
    assert sorted(losses(out)) == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_torn_log_line_and_a_killed_save_and_rotation_are_cleared_at_resume(tmp_path, args, four_step_run):
    out = tmp_path / "killed"
    out.mkdir()
    shutil.copytree(four_step_run / "step_2", out / "step_2")
    shutil.copytree(four_step_run / "step_4", out / ".incomplete_step_4")  # killed before its rename
    shutil.copytree(four_step_run / "step_2", out / ".deleting_step_1")  # killed while rotation deleted it
    (out / ".deleting_step_1" / "position.json").unlink()
    logged = (four_step_run / "log.jsonl").read_text().splitlines()
    (out / "log.jsonl").write_text("\n".join(logged[:3]) + "\n" + logged[3][:17])  # killed while appending
    result = run_train([*args, "--max_steps", 4, "--save_steps", 2, "--output_dir", out, "--resume", "latest"])
    assert f"warning: {out / 'log.jsonl'}: dropped its last line, cut short" in result.stderr
    assert f"removed what an interrupted run left in {out}: .deleting_step_1, .incomplete_step_4" in result.stdout
    assert sorted(os.listdir(out)) == [".lock", "eval.jsonl", "log.jsonl", "model", "run.json", "step_2", "step_4"]
    assert [row["step"] for row in read_log(out) if "loss" in row] == [1, 2, 3, 4]
    assert losses(out) == losses(four_step_run)


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_the_previous_checkpoint_resumes_exactly(
        tmp_path, args, four_step_run):
    run = [*args, "--max_steps", 4, "--save_steps", 2]
    # 3 MiB: step_4's weights (2.4 MiB) fit, its optimizer state (4.7 MiB) does not.
    with full_disk(tmp_path / "disk", 3 * MiB, four_step_run / "step_2") as (out, limit):
        result = run_limited(train_command([*run, "--output_dir", out, "--resume", "latest"]), limit)
        assert_refused(result, f"cannot save checkpoint {out / 'step_4'}: "
                               + ("File too large" if limit else "No space left on device"))  # not torch's words
        assert f"free space (or choose another --output_dir), then continue with --resume latest (the newest " \
               f"complete checkpoint, {out / 'step_2'}, is untouched)" in result.stderr
        assert sorted(p.name for p in out.iterdir()) == [".lock", "eval.jsonl", "log.jsonl", "run.json", "step_2"]
        shutil.copytree(out / "step_2", tmp_path / "step_2")
    resumed = tmp_path / "resumed"
    run_train([*run, "--output_dir", resumed, "--resume", tmp_path / "step_2"])
    assert losses(resumed) == {step: loss for step, loss in losses(four_step_run).items() if step > 2}


@pytest.mark.slow
def test_a_full_disk_under_accelerate_launch_is_one_line_from_rank_0_and_every_rank_stops(tmp_path, args):
    with full_disk(tmp_path / "disk", 3 * MiB) as (out, limit):  # the first checkpoint's optimizer state fails
        result = run_limited(train_command([*args, "--max_steps", 4, "--save_steps", 2, "--output_dir", out],
                                           CPU_YAML), limit)
        errors = error_lines(result.stderr)
        assert result.returncode != 0 and errors == [
            f"error: cannot save checkpoint {out / 'step_2'}: " + errors[0].split(": ", 2)[2]], result.stderr[-3000:]
        assert "and start again: no checkpoint was completed yet" in errors[0]
        assert not [p for p in out.iterdir() if p.name.startswith("step_")]
        # Rank 1, whose barrier fails once rank 0 has ended, prints nothing of its own (no gloo traceback).
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        after = lines[lines.index(errors[0]) + 1:]
        launcher_report = after.index("Traceback (most recent call last):")
        assert all(TORCHRUN_LOG_LINE.match(line) for line in after[:launcher_report]), "\n".join(after)


@pytest.mark.slow
def test_a_full_disk_during_the_export_is_one_line_and_leaves_no_partial_model(tmp_path, args, four_step_run):
    # 1 MiB: the run's logs fit, the exported weights (2.4 MiB) do not.
    with full_disk(tmp_path / "disk", 1 * MiB, four_step_run / "step_2") as (out, limit):
        result = run_limited(train_command([*args, "--max_steps", 4, "--save_strategy", "no", "--output_dir", out,
                                            "--resume", "latest"]), limit)
        assert_refused(result, f"cannot export the model to {out / 'model'}")
        assert "--resume latest" in error_lines(result.stderr)[0]
        assert sorted(p.name for p in out.iterdir()) == [".lock", "eval.jsonl", "log.jsonl", "run.json", "step_2"]
        from textclf.checkpointing.verify import read_position, verify_files
        verify_files(str(out / "step_2"), read_position(str(out / "step_2")))  # still whole


@pytest.mark.slow
@pytest.mark.parametrize("module", ["textclf.predict", "textclf.report"])
def test_a_full_disk_under_predict_or_report_is_one_line_and_leaves_nothing_half_written(
        tmp_path, tiny_model, reviews_csv, module):
    """predict's --output (the rows do not fit), report's picture (report.json fits, the picture does not)."""
    free, written, args = ((50, "pred.csv", ["--file", reviews_csv, "--output", "{out}/pred.csv"])
                           if module == "textclf.predict" else
                           (8 * 1024, "report/confusion_matrix.png",
                            ["--file", reviews_csv, "--label_column", "label", "--no_baseline", "--output_dir",
                             "{out}/report"]))
    with full_disk(tmp_path / "disk", free) as (out, limit):
        command = [sys.executable, "-m", module, "--model", str(tiny_model),
                   *[str(arg).format(out=out) for arg in args]]
        result = run_limited(command, limit)
        reason = "File too large" if limit else "No space left on device"
        errors = error_lines(result.stderr)
        assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
        assert errors[0].startswith(f"error: cannot write {out / written}: {reason} (") and \
            "Traceback" not in result.stderr, result.stderr[-3000:]
        left = [str(path.relative_to(out)) for path in out.rglob("*")]
        assert not [name for name in left if "incomplete" in name or name.endswith(".tmp")], left
        assert written not in left


@pytest.mark.slow
@pytest.mark.parametrize("zoo_file", ["cpu.yaml", "zero2.yaml"])
def test_a_user_error_under_accelerate_launch_is_said_once_by_rank_0_and_ends_what_the_ranks_print(
        tmp_path, args, zoo_file):
    missing = tmp_path / "missing.csv"
    process = launch(train_command([*args, "--data", missing, "--output_dir", tmp_path / "out"],
                                   REPO / "accelerate_configs" / zoo_file))
    lines = [line.rstrip("\n") for line in finish(process).splitlines() if line.strip()]
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert len(errors) == 1 and lines[errors[0]].startswith(f"error: data not found: {missing}"), "\n".join(lines)
    # After it, only the launcher's report: torchrun's log lines, then its ChildFailedError, whose root
    # cause is rank 0 with exit code 2 and quotes the error (torch's error file), not a traceback link.
    after = lines[errors[0] + 1:]
    report = after.index("Traceback (most recent call last):")
    assert all(TORCHRUN_LOG_LINE.match(line) for line in after[:report]), "\n".join(after)
    root_cause = "\n".join(after[after.index("Root Cause (first observed failure):"):])
    assert "rank      : 0 (local_rank: 0)" in root_cause and "exitcode  : 2" in root_cause
    assert f"traceback : {lines[errors[0]]}" in root_cause
    assert after[-1].startswith("=====") and process.returncode == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("module, how", [("textclf.predict", "SIGTERM"), ("textclf.predict", "SIGINT"),
                                         ("textclf.predict", "timeout"), ("textclf.report", "SIGTERM")])
def test_a_stopped_inference_launch_leaves_no_process_behind(tmp_path, tiny_model, many_reviews, module, how):
    work = (["--output", tmp_path / "out.csv"] if module == "textclf.predict" else
            ["--label_column", "label", "--output_dir", tmp_path / "report"])
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_YAML),
               "--main_process_port", str(free_port()), "-m", module, "--model", str(tiny_model),
               "--file", str(many_reviews), *map(str, work)]
    process = launch(["timeout", "900", *command] if how == "timeout" else command)
    wait_until(lambda: len(ranks_of(process, module)) == 2 and any("predict:" in line for line in process.lines),
               "both ranks predict")
    started = descendants(process)
    stop(process, how)
    output = finish(process, timeout=300)
    assert process.returncode != 0, output[-3000:]
    wait_until(lambda: all_gone(started), "every process of the launch has ended", timeout=120)
    assert not (tmp_path / "out.csv").exists() and not (tmp_path / "report").exists()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "timeout"])
def test_a_benchmark_stopped_mid_row_leaves_no_process_behind(tmp_path, reviews_csv, how):
    """The benchmark runs each row in a session of its own (so that a terminal's Ctrl-C reaches the
    benchmark alone); stopped while a row's two ranks train, it stops them, the rows after it never start, and the
    row that finished before is in bench.json and bench.md."""
    command = [sys.executable, "-m", "benchmarks", "--quick", "--steps", "3", "--only", "single,cpu,single_small",
               "--data", str(reviews_csv), "--output_dir", str(tmp_path)]
    process = launch(["timeout", "900", *command] if how == "timeout" else command)
    wait_until(lambda: len(ranks_of(process, "train.py")) == 2, "the cpu row's ranks have started")
    started = descendants(process)
    stop(process, how)
    output = finish(process, timeout=300)
    assert process.returncode != 0, output[-3000:]
    wait_until(lambda: all_gone(started), "every process of the benchmark has ended", timeout=120)
    assert not (tmp_path / "runs" / "single_small").exists(), output[-3000:]
    finished = json.loads((tmp_path / "bench.json").read_text(encoding="utf-8"))
    assert [(row["name"], row["status"]) for row in finished] == [("single", "ok")], output[-3000:]
    assert "| single |" in (tmp_path / "bench.md").read_text(encoding="utf-8")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["timeout", "SIGTERM"])
def test_a_training_launch_stopped_by_timeout_checkpoints_and_leaves_no_process_behind(tmp_path, args, how):
    """`timeout` (SIGTERM to the launch's process group), or a SIGTERM to `accelerate launch` alone (a scheduler,
    `kill`): torchrun passes it on to both ranks, which checkpoint at the next log line and stop."""
    out = tmp_path / "out"
    command = train_command([*args, "--max_steps", 500, "--output_dir", out], CPU_YAML)
    process = launch(["timeout", "900", *command] if how == "timeout" else command)
    wait_until(lambda: (out / "log.jsonl").exists() and len(read_log(out)) >= 2, "training has begun")
    started = descendants(process)
    stop(process, how)
    output = finish(process, timeout=300)
    wait_until(lambda: all_gone(started), "every process of the launch has ended", timeout=120)
    last = max(losses(out))
    assert f"stopped by SIGTERM at step {last}; continue with: --resume {out / f'step_{last}'}" in output
    assert (out / f"step_{last}" / "position.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("config_file", [None, CPU_YAML], ids=["one-process", "cpu.yaml"])
def test_ctrl_c_checkpoints_at_the_next_log_line_and_says_how_to_resume_on_a_line_of_its_own(
        tmp_path, args, config_file):
    out = tmp_path / "out"
    process = launch(train_command([*args, "--max_steps", 500, "--output_dir", out], config_file))
    wait_until(lambda: (out / "log.jsonl").exists() and len(read_log(out)) >= 2, "training has begun")
    started = descendants(process)
    stop(process, "SIGINT")  # under accelerate launch, torchrun passes it on to both ranks
    output = finish(process, timeout=300)
    wait_until(lambda: all_gone(started), "every process of the launch has ended", timeout=120)
    last = max(losses(out))
    lines = output.split("\n")
    assert f"stopped by SIGINT at step {last}; continue with: --resume {out / f'step_{last}'}" in lines, output[-3000:]
    assert "SIGINT: saving a checkpoint at the next logging step (--logging_steps 1), then stopping; Ctrl-C again " \
           "stops at once, without it" in lines
    assert (out / f"step_{last}" / "position.json").exists() and last < 500
    assert "KeyboardInterrupt" not in output
    if config_file is None:  # torchrun itself exits non-zero when it receives the signal
        assert process.returncode == 0 and "Traceback" not in output, output[-3000:]


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path, args):
    out = tmp_path / "out"
    # A log line (and so the stop) only far ahead; an evaluation at every step shows that training runs.
    process = launch(train_command([*args, "--max_steps", 10 ** 5, "--logging_steps", 10 ** 5, "--save_steps", 10 ** 5,
                                    "--eval_steps", 1, "--output_dir", out]))
    wait_until(lambda: (out / "log.jsonl").exists() and len(read_log(out)) >= 1, "training has begun")
    stop(process, "SIGINT")
    wait_until(lambda: any(line.startswith("SIGINT: saving a checkpoint") for line in process.lines),
               "the first Ctrl-C is acknowledged")
    stop(process, "SIGINT")
    output = finish(process, timeout=300)  # the run would otherwise go on to its next log line, 10^5 steps on
    assert process.returncode == -signal.SIGINT, output[-3000:]
    assert not [path for path in out.iterdir() if "step_" in path.name] and "Traceback" not in output


def test_slurm_script_forwards_the_time_limit_s_sigterm_and_requeues_the_same_command(tmp_path):
    """scripts/slurm.sbatch under stand-ins for srun, scontrol and accelerate: the SIGTERM SLURM sends the batch
    shell before the time limit reaches the launch, whose run saves and exits 0, and the job requeues itself;
    the launch carries --resume auto, so the requeued job continues."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"',  # drop srun's options, run the task
        "scontrol": f'[ "$1" = show ] && echo node1 || echo "$@" >> {tmp_path}/scontrol',
        # The trap first: the test signals once the launch line is written.
        "accelerate": f'trap "echo saved > {tmp_path}/saved; exit 0" TERM; echo "$@" > {tmp_path}/launch; '
                      'while :; do sleep 0.05; done',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1",
           "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_ID": "77"}
    job = subprocess.Popen(["bash", str(REPO / "scripts" / "slurm.sbatch"), "--output_dir", "/shared/run"], cwd=REPO,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (tmp_path / "launch").exists(), job, timeout=30)
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=30)
    assert job.returncode == 0, stderr
    assert (tmp_path / "saved").exists()  # the launch got the SIGTERM, and the script waited for it to end
    assert (tmp_path / "scontrol").read_text().split() == ["requeue", "77"]
    assert "train.py --resume auto --output_dir /shared/run" in (tmp_path / "launch").read_text()


@pytest.mark.slow
def test_a_run_into_a_folder_with_links_planted_at_its_outputs_writes_none_of_their_targets(
        tmp_path, victim, reviews_csv, cache_dir):
    out = tmp_path / "out"
    for name in ("run.json", "run.json.tmp", "log.jsonl.tmp", "eval.jsonl", "eval.jsonl.tmp"):
        plant(out / name, victim / "file")
    for name in ("step_2", ".incomplete_step_2", "model", ".model.incomplete"):
        plant(out / name, victim / "folder")
    run_train([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", 2, "--save_steps", 2,
               "--output_dir", out, "--overwrite_output_dir"])
    assert untouched(victim)
    assert sorted(os.listdir(out)) == [".lock", "eval.jsonl", "log.jsonl", "model", "run.json", "step_2"]
    assert not any((out / name).is_symlink() for name in os.listdir(out))
