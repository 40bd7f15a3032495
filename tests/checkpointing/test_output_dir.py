"""The output folder one run owns (textclf/checkpointing/output_dir.py): its lock, --overwrite_output_dir and what it
may not move, a folder that is a file, links planted where it writes, failed claims and full disks."""

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import (
    OFFLINE,
    REPO,
    TINY,
    assert_refused,
    full_disk,
    plant,
    run_train,
    untouched,
)
from textclf.cli import parse_config
from textclf.errors import InputError


def wait_until(condition, what, timeout=600):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def run_limited(command, limit) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, **OFFLINE},
                          preexec_fn=limit, timeout=900)


def old_run(out: Path) -> Path:
    """A previous run's folder: a checkpoint and its log."""
    (out / "step_2").mkdir(parents=True)
    (out / "step_2" / "position.json").write_text("{}")
    (out / "log.jsonl").write_text('{"step": 1}\n')
    return out


def listing(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_an_output_dir_that_is_a_file_says_so_before_torch(tmp_path):
    (tmp_path / "run").write_text("")
    result = subprocess.run([sys.executable, "-X", "importtime", "train.py", "--output_dir", str(tmp_path / "run")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and said == [f"error: --output_dir {tmp_path / 'run'} is a file, not a folder; "
                                               "choose another --output_dir (or move that file away)"], said
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert "torch" not in imported


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


def test_a_link_in_place_of_the_lock_is_refused_and_its_target_left_alone(tmp_path, victim):
    from textclf.checkpointing.output_dir import refuse_if_in_use, take_lock

    out = tmp_path / "out"
    plant(out / ".lock", victim / "file")
    refuse_if_in_use(str(out))  # the probe reads no link either
    with pytest.raises(InputError) as refused:
        take_lock(str(out))
    assert str(refused.value) == (f"cannot lock {out}: {out / '.lock'} is a symbolic link (to {victim / 'file'}), and "
                                  "a run never writes through one; remove the link (or choose another folder), then "
                                  "run again")
    assert untouched(victim)


@pytest.mark.parametrize("inside", ["--data", "--eval_data", "--model"])
def test_overwrite_output_dir_is_refused_where_the_folder_holds_what_the_run_reads(tmp_path, reviews_csv, inside,
                                                                                   tiny_model):
    from textclf.cli import plan_run
    from textclf.errors import InputError

    out = old_run(tmp_path / "out")
    read = {"--data": reviews_csv, "--eval_data": reviews_csv, "--model": tiny_model}[inside]
    moved_in = out / ("model" if inside == "--model" else "reviews.csv")
    shutil.copytree(read, moved_in) if inside == "--model" else shutil.copy(read, moved_in)
    before = listing(out)
    args = [*TINY, "--data", reviews_csv, "--output_dir", out, "--overwrite_output_dir", inside, moved_in]
    with pytest.raises(InputError) as refused:
        plan_run(parse_config(list(map(str, args))))
    assert str(refused.value) == (f"--overwrite_output_dir would move the run in {out} aside, and this run reads "
                                  f"{inside} {moved_in} from there; move it out of {out} first, or choose another "
                                  "--output_dir")
    assert listing(out) == before and os.listdir(tmp_path) == ["out"]
    # What it reads elsewhere leaves the old run free to move aside, as before.
    outside = [*TINY, "--data", reviews_csv, "--output_dir", out, "--overwrite_output_dir"]
    cfg, start = plan_run(parse_config(list(map(str, outside))))
    assert start.checkpoint is None


def test_a_resume_into_another_folder_may_not_move_aside_the_data_its_checkpoint_recorded(tmp_path):
    from textclf.checkpointing.plan import read_resume
    from textclf.config import TrainConfig
    from textclf.errors import InputError

    out = old_run(tmp_path / "out")
    (out / "reviews.csv").write_text("label,review\npositive,好\n")
    checkpoint = tmp_path / "first" / "step_4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "position.json").write_text(json.dumps({"config": {"data": str(out / "reviews.csv")}}))
    cfg = TrainConfig(resume=str(checkpoint), output_dir=str(out), overwrite_output_dir=True)
    with pytest.raises(InputError, match=f"reads --data {out / 'reviews.csv'} from there"):
        read_resume(cfg, [])


def test_overwrite_output_dir_with_the_data_inside_is_one_line_from_train_py_and_moves_nothing(tmp_path, reviews_csv,
                                                                                                cache_dir):
    out = old_run(tmp_path / "out")
    shutil.copy(reviews_csv, out / "reviews.csv")
    before = listing(out)
    result = run_train([*TINY, "--data", out / "reviews.csv", "--cache_dir", cache_dir, "--max_steps", 1,
                        "--output_dir", out, "--overwrite_output_dir"], check=False)
    assert_refused(result, "--overwrite_output_dir would move the run in")
    assert listing(out) == before and os.listdir(tmp_path) == ["out"]


def test_a_failed_claim_removes_the_empty_folders_it_made_and_keeps_what_was_there(tmp_path, accelerator,
                                                                                    monkeypatch):
    from textclf import files
    from textclf.checkpointing.output_dir import claim_output_dir
    from textclf.errors import InputError

    monkeypatch.setattr(files, "open_lock", no_space)
    made = tmp_path / "new" / "out"
    with pytest.raises(InputError, match=f"cannot lock {made}: No space left on device"):
        claim_output_dir(accelerator, str(made), None, False, None)
    assert os.listdir(tmp_path) == []
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(InputError):
        claim_output_dir(accelerator, str(existing), None, False, None)
    assert existing.is_dir()
