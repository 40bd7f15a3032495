"""Checkpoints rotated (textclf/checkpointing/rotation.py): the newest and the best kept, by the task's direction,
through a rename a kill cannot leave half done."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import (
    REPO,
)
from textclf.checkpointing.folders import complete_checkpoints
from textclf.checkpointing.rotation import rotate
from textclf.checkpointing.write import complete


def checkpoint(output_dir, step, **metrics):
    folder = output_dir / f"step_{step}"
    folder.mkdir(parents=True)
    complete(str(folder), {"step": step, "epoch": 0, "batch_in_epoch": step, "metrics": metrics})
    return folder


def test_rotation_keeps_the_newest_checkpoint_beside_the_best(tmp_path):
    for step, f1 in [(2, 0.9), (4, 0.5), (6, 0.4)]:
        checkpoint(tmp_path, step, eval_f1=f1)
    rotate(str(tmp_path), keep=1, metric="eval_f1", protect=None)
    assert [step for step, _ in complete_checkpoints(str(tmp_path))] == [2, 6]  # the best, and the newest


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


def test_rotation_rule_spares_an_old_best_and_the_checkpoint_resumed_from(tmp_path):
    from textclf.checkpointing.rotation import rotate

    for step, f1 in [(10, 0.9), (20, 0.5), (30, 0.6), (40, 0.7), (50, 0.4)]:
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "position.json").write_text(json.dumps({"metrics": {"eval_f1": f1}}))
    (tmp_path / ".incomplete_step_60").mkdir()
    rotate(str(tmp_path), keep=2, metric="eval_f1", protect=str(tmp_path / "step_20"))
    assert sorted(os.listdir(tmp_path)) == [".incomplete_step_60", "step_10", "step_20", "step_40", "step_50"]


def test_rotation_keeps_the_lowest_when_lower_is_better(tmp_path):
    from textclf.checkpointing.rotation import rotate

    for step, mse in [(10, 0.5), (20, 0.2), (30, 0.9), (40, 0.7)]:
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "position.json").write_text(json.dumps({"metrics": {"eval_mse": mse}}))
    rotate(str(tmp_path), keep=1, metric="eval_mse", protect=None, greater_is_better=False)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step_20", "step_40"]
