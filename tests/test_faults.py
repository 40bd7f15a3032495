"""Faults: two runs in one folder, --overwrite_output_dir, full disks, torn logs, killed rotations,
stale build locks, stopped launches, user errors under `accelerate launch` (docs/faults.md lists them
with the test that covers each). Exact resume itself is tests/test_resume.py's."""

import io
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import psutil
import pytest

from conftest import OFFLINE, REPO, TINY, assert_refused, free_port, losses, read_log, run_train, train_command

CPU_YAML = REPO / "accelerate_configs" / "cpu.yaml"
MiB = 2 ** 20


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


# --- One run per output folder ---------------------------------------------------------------------------

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


def test_a_run_waiting_on_the_lock_while_overwrite_moves_the_folder_aside_does_not_take_it_too(tmp_path, monkeypatch):
    """Run A (--overwrite_output_dir) holds <dir>/.lock and moves the folder aside, lock file and all, while
    run B, which opened that .lock, waits to lock it: when A lets go of the moved file, B must see that it is
    no longer the folder's .lock (which A now holds) and be refused, not own the folder beside A. flock
    locks belong to open files, so two threads that each open .lock contend as two processes do. The
    delays are injected: A's rename waits until B has opened the lock file, B's lock until A is done."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from textclf.checkpointing import output_dir as checkpoint
    from textclf.errors import InputError

    out = tmp_path / "run"
    out.mkdir()
    (out / "log.jsonl").write_text("the previous run\n")
    runs = {}
    b_opened, a_done = threading.Event(), threading.Event()
    real_flock, real_rename = checkpoint.fcntl.flock, os.rename

    def flock(file, operation):
        if threading.current_thread().name == "B" and not b_opened.is_set():
            b_opened.set()
            assert a_done.wait(timeout=60)
        return real_flock(file, operation)

    def slow_rename(source, target):  # the window of the issue, made as long as it takes
        assert b_opened.wait(timeout=60)
        real_rename(source, target)

    monkeypatch.setattr(checkpoint.fcntl, "flock", flock)
    monkeypatch.setattr(os, "rename", slow_rename)
    accelerator = Accelerator(cpu=True)

    def claim(name):
        try:
            checkpoint.claim_output_dir(accelerator, str(out), None, True, None)
            runs[name] = "owns it"
        except InputError as e:
            runs[name] = str(e)
        finally:
            if name == "A":
                a_done.set()

    a = threading.Thread(target=claim, args=("A",), name="A")
    a.start()
    wait_until(lambda: (out / ".lock").exists() and (out / ".lock").read_text(), "A holds the lock")
    b = threading.Thread(target=claim, args=("B",), name="B")
    b.start()
    a.join(timeout=120)
    b.join(timeout=120)
    AcceleratorState._reset_state(True)
    try:
        assert runs["A"] == "owns it"
        assert runs["B"].startswith(f"{out} is in use by another run (pid {os.getpid()} on "), runs
        aside = [path for path in tmp_path.iterdir() if path.name.startswith("run.replaced-")]
        assert len(aside) == 1 and (aside[0] / "log.jsonl").read_text() == "the previous run\n"
        assert os.listdir(out) == [".lock"]  # A's new folder, which B never took
    finally:
        for held in [f for f in checkpoint._held_locks if f.name.startswith(str(tmp_path))]:
            checkpoint._held_locks.remove(held)
            held.close()


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


def test_a_resume_by_path_over_later_checkpoints_is_refused_unless_overwrite(tmp_path):
    from textclf.checkpointing.folders import find_resume_checkpoint
    from textclf.errors import InputError

    for step in (2, 4):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "position.json").write_text("{}")
    earlier, out = str(tmp_path / "step_2"), str(tmp_path)
    with pytest.raises(InputError) as refused:
        find_resume_checkpoint(earlier, out, overwrite=False)
    assert str(refused.value) == (f"--resume {earlier}: {out} holds checkpoints after it (step_4), which this run "
                                  "would write over; pass --overwrite_output_dir to move them aside, or --output_dir "
                                  "<another folder> to keep both runs")
    assert find_resume_checkpoint(earlier, out, overwrite=True) == earlier
    assert find_resume_checkpoint(str(tmp_path / "step_4"), out, overwrite=False) == str(tmp_path / "step_4")


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


# --- What a killed run leaves: a torn log line, half-saved and half-deleted checkpoints ----------------------

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


def test_keep_log_until_drops_a_torn_last_line_but_refuses_damage_elsewhere(tmp_path, capsys):
    from textclf.errors import InputError
    from textclf.loop.tracking import keep_log_until

    rows = [json.dumps({"step": step, "loss": 0.5}) for step in (1, 2, 3)]
    (tmp_path / "log.jsonl").write_bytes(("\n".join(rows) + "\n" + rows[2][:9]).encode() + "\xe4\xbd".encode("latin-1"))
    keep_log_until(str(tmp_path), 2)
    assert (tmp_path / "log.jsonl").read_text() == rows[0] + "\n" + rows[1] + "\n"
    assert "dropped its last line" in capsys.readouterr().err
    (tmp_path / "log.jsonl").write_text(rows[0] + "\n{\"step\": 2, \"lo\n" + rows[2] + "\n")
    with pytest.raises(InputError, match="line 2 is damaged"):
        keep_log_until(str(tmp_path), 3)


def test_rotation_killed_while_deleting_leaves_no_half_checkpoint_and_the_next_start_clears_it(tmp_path):
    from textclf.checkpointing.folders import complete_checkpoints
    from textclf.checkpointing.output_dir import remove_leftovers

    for step in (1, 2, 3):  # checkpoints of many small files, so that deleting one takes a while
        folder = tmp_path / f"step_{step}"
        (folder / "files").mkdir(parents=True)
        for i in range(3000):
            (folder / "files" / f"{i:05d}").write_text("x")
        (folder / "position.json").write_text(json.dumps({"step": step}))
    # The rotation kills itself (SIGKILL, as the OOM killer would) after its 100th file deletion: mid-way through
    # deleting a checkpoint, whatever the machine's load, instead of racing a kill from outside.
    killed_mid_deletion = (
        "import os, signal, sys\n"
        "from textclf.checkpointing import rotate\n"
        "unlink, deleted = os.unlink, []\n"
        "def unlink_then_die(*args, **kwargs):\n"
        "    unlink(*args, **kwargs)\n"
        "    deleted.append(1)\n"
        "    if len(deleted) == 100:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "os.unlink = unlink_then_die\n"
        "rotate(sys.argv[1], keep=1, metric='eval_f1', protect=None)\n")
    rotation = subprocess.run([sys.executable, "-c", killed_mid_deletion, str(tmp_path)], cwd=REPO, timeout=120)
    assert rotation.returncode == -signal.SIGKILL
    assert any(p.name.startswith(".deleting_") for p in tmp_path.iterdir()), "the kill came after the deletion"
    # Whatever the kill interrupted, every folder named like a checkpoint is whole.
    for _, path in complete_checkpoints(str(tmp_path)):
        assert len(os.listdir(Path(path) / "files")) == 3000
    assert "step_3" in os.listdir(tmp_path)
    removed = remove_leftovers(str(tmp_path))
    assert removed and all(name.startswith(".deleting_step_") for name in removed)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_deletion_or_lock_that_fails_is_one_line_and_leaves_the_checkpoint_whole(tmp_path, monkeypatch):
    """Rotation, a leftover's removal and the output folder's lock fail as one line, not a traceback."""
    import errno

    from textclf.checkpointing.folders import complete_checkpoints
    from textclf.checkpointing.output_dir import remove_leftovers, take_lock
    from textclf.checkpointing.rotation import rotate
    from textclf.errors import InputError

    for step in (1, 2):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "position.json").write_text(json.dumps({"step": step}))
    (tmp_path / ".deleting_step_0").mkdir()

    def read_only(*_, **__):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    with monkeypatch.context() as patched:
        patched.setattr(os, "rename", read_only)
        with pytest.raises(InputError, match=r"cannot delete the checkpoint .*step_1: Read-only file system .*"
                                             "then continue with --resume latest"):
            rotate(str(tmp_path), keep=1, metric="eval_f1", protect=None)
        patched.setattr(shutil, "rmtree", read_only)
        with pytest.raises(InputError, match=r"cannot remove the leftover .*\.deleting_step_0: Read-only file"):
            remove_leftovers(str(tmp_path))
    assert [step for step, _ in complete_checkpoints(str(tmp_path))] == [1, 2]
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / ".lock").mkdir()  # the lock file cannot be opened (as on a read-only folder)
    with pytest.raises(InputError, match=r"cannot lock .*locked: Is a directory .*choose another --output_dir"):
        take_lock(str(tmp_path / "locked"))


# --- The loop position, checked against this run's schedule ------------------------------------------------

SCHEDULE = {"total_steps": 20, "steps_per_epoch": 5, "batches_per_epoch": 14, "gradient_accumulation_steps": 3,
            "world_size": 2}
WINDOWS = [{"loss_sum": 0.0, "losses": 0, "samples": 0, "real_tokens": 0, "padded_tokens": 0}] * 2
BAD_POSITIONS = {
    "string step": ({"step": "6"}, ['step is "6", expected a whole number >= 0']),
    "fractional step": ({"step": 6.5}, ["step is 6.5"]),
    "negative epoch": ({"epoch": -1}, ["epoch is -1"]),
    "boolean batch": ({"batch_in_epoch": True}, ["batch_in_epoch is true"]),
    "step past the end": ({"step": 26, "epoch": 5, "batch_in_epoch": 3}, ["past the end of this run at step 20"]),
    "batch past the epoch": ({"batch_in_epoch": 15}, ["outside this run's epoch of 14 batches"]),
    "epoch that the step is not in": ({"epoch": 2}, ["step 6 is not where epoch 2, batch 3"]),
    "window of one rank": ({"loss_window": WINDOWS[:1]}, ["loss_window is not one loss window"]),
    "two violations": ({"step": "6", "loss_window": None}, ["step is", "loss_window is not"]),
}


@pytest.mark.parametrize("case", BAD_POSITIONS)
def test_a_position_outside_the_schedule_is_one_line_per_violation(case):
    from textclf.checkpointing.load import check_position
    from textclf.errors import InputError

    changes, messages = BAD_POSITIONS[case]
    position = {"step": 6, "epoch": 1, "batch_in_epoch": 3, "loss_window": WINDOWS, **changes}
    with pytest.raises(InputError) as refused:
        check_position("ckpt", position, **SCHEDULE)
    lines = str(refused.value).splitlines()
    assert len(lines) == len(messages) and all(m in line for m, line in zip(messages, lines)), lines
    check_position("ckpt", {"step": 6, "epoch": 1, "batch_in_epoch": 3, "loss_window": WINDOWS}, **SCHEDULE)
    check_position("ckpt", {"step": 5, "epoch": 0, "batch_in_epoch": 14, "loss_window": WINDOWS}, **SCHEDULE)


# --- Full disks ---------------------------------------------------------------------------------------------

def tmpfs_allowed() -> bool:
    probe = Path(f"/tmp/textclf-tmpfs-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
                                 capture_output=True).returncode == 0
        if mounted:
            subprocess.run(["umount", str(probe)], check=True)
        return mounted
    except OSError:
        return False
    finally:
        probe.rmdir()


@contextmanager
def full_disk(folder: Path, free_bytes: int, preload: Optional[Path] = None):
    """An output_dir where writing `free_bytes` more fails for real, with `preload` (a checkpoint) copied
    in first: on a tmpfs of just that size where this machine lets root mount one; otherwise an ordinary
    folder and a limit on the size of each file the command writes (RLIMIT_FSIZE: Python ignores SIGXFSZ,
    so the write fails with EFBIG). Yields (output_dir, preexec_fn for the command)."""
    folder.mkdir()
    out = folder / "out"
    if tmpfs_allowed():
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={100 * MiB}", "tmpfs", str(folder)], check=True)
        try:
            out.mkdir()
            if preload:
                shutil.copytree(preload, out / preload.name)
            (folder / "filler").write_bytes(b"\0" * (shutil.disk_usage(folder).free - free_bytes))
            yield out, None
        finally:
            subprocess.run(["umount", "-l", str(folder)], check=False)
    else:
        out.mkdir()
        if preload:
            shutil.copytree(preload, out / preload.name)
        yield out, lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (free_bytes, free_bytes))


def run_limited(command, limit) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, **OFFLINE},
                          preexec_fn=limit, timeout=900)


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


def test_a_full_disk_while_the_lock_is_written_is_one_line_and_leaves_no_lock_file(tmp_path):
    taking = ("import sys\n"
              "from textclf.checkpointing.output_dir import take_lock\n"
              "from textclf.errors import run_command\n"
              "run_command(lambda: take_lock(sys.argv[1]))\n")
    with full_disk(tmp_path / "disk", 0) as (out, limit):
        result = run_limited([sys.executable, "-c", taking, str(out)], limit)
        reason = "File too large" if limit else "No space left on device"
        assert result.returncode == 2 and result.stderr.startswith(f"error: cannot lock {out}: {reason} ("), \
            result.stderr
        assert len(result.stderr.splitlines()) == 1 and os.listdir(out) == []


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


def test_a_pickle_only_model_folder_is_one_line_and_runs_nothing(tmp_path, tiny_model):
    import pickle

    from conftest import refusal
    from textclf.predict import main

    class RunsCode:
        def __reduce__(self):
            return (open, (str(tmp_path / "code-ran"), "w"))

    folder = shutil.copytree(tiny_model, tmp_path / "model")
    (folder / "model.safetensors").unlink()
    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump(RunsCode(), f)
    error = refusal(main, ["--model", folder, "--text", "好", "--output", tmp_path / "p.jsonl"])
    assert "its weights are a pickle that holds more than tensors" in error
    assert not (tmp_path / "code-ran").exists() and not (tmp_path / "p.jsonl").exists()


# --- Launches: user errors, stops, DeepSpeed's compilation ----------------------------------------------

# torch logs its file's path relative to the working directory when it can: a virtual environment
# inside the repository (.venv, as CI has it) puts one before torch/.
TORCHRUN_LOG_LINE = re.compile(r"^[WEI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ (\S+/)?torch/distributed/")


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
