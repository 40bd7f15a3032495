"""Where checkpoints are and which one a run continues (textclf/checkpointing/folders.py): step_<N>/ folders, complete
ones, --resume latest, auto or a path, later checkpoints, a lost position.json, the best checkpoint wherever the folder
moved, a resume through a link, a fresh run into another run's folder."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (
    REPO,
    TINY,
    losses,
    run_train,
)
from textclf.checkpointing.folders import POSITION, find_best_checkpoint
from textclf.errors import InputError


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)


def release_locks_under(folder: Path) -> None:
    """Close the locks this process took under `folder` (claim_output_dir keeps them for the run's life)."""
    from textclf.checkpointing import output_dir

    for held in [f for f in output_dir._held_locks if f.name.startswith(str(folder))]:
        output_dir._held_locks.remove(held)
        held.close()


def old_run(out: Path) -> Path:
    """A previous run's folder: a checkpoint and its log."""
    (out / "step_2").mkdir(parents=True)
    (out / "step_2" / "position.json").write_text("{}")
    (out / "log.jsonl").write_text('{"step": 1}\n')
    return out


def test_the_best_checkpoint_is_found_where_the_run_goes_on_else_where_it_was_saved(tmp_path):
    from textclf.errors import InputError

    saved, moved = tmp_path / "first" / "step_4", tmp_path / "moved" / "step_4"
    best = {"step": 4, "checkpoint": str(saved)}
    with pytest.raises(InputError, match=r"the best checkpoint so far \(step 4, saved as .*first/step_4\) is neither "
                                         r"there nor in .*moved: put it back"):
        find_best_checkpoint(best, str(moved.parent))
    for folder in (saved, moved):
        folder.mkdir(parents=True)
        (folder / "position.json").write_text("{}")
    assert find_best_checkpoint(best, str(tmp_path / "elsewhere")) == str(saved)  # resumed into another folder
    assert find_best_checkpoint(best, str(moved.parent)) == str(moved)  # the run's folder, moved


def test_a_fresh_run_into_another_run_s_folder_suggests_another_folder(tmp_path):
    from textclf.checkpointing.folders import find_checkpoint
    from textclf.config import TrainConfig

    step = tmp_path / "run" / "step_4"
    step.mkdir(parents=True)
    (step / "position.json").write_text(json.dumps({"step": 4, "config": TrainConfig().to_dict()}))
    with pytest.raises(InputError, match=r"already holds checkpoints \(newest .*step_4\); pass --resume latest"):
        find_checkpoint(TrainConfig(output_dir=str(tmp_path / "run")))
    with pytest.raises(InputError, match=r"already holds checkpoints of another run \(newest .*step_4, made with "
                                         r"learning_rate = 0.001, this run has 0.1\); choose another --output_dir"):
        find_checkpoint(TrainConfig(output_dir=str(tmp_path / "run"), learning_rate=0.1))
    # What may change on a resume is no other run.
    with pytest.raises(InputError, match="pass --resume latest"):
        find_checkpoint(TrainConfig(output_dir=str(tmp_path / "run"), max_steps=99, logging_steps=7))


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


def test_a_deleted_position_json_is_named_when_resume_latest_falls_back(tmp_path, four_step_run, capsys):
    from textclf.checkpointing.folders import choose_checkpoint, find_resume_checkpoint

    out = shutil.copytree(four_step_run, tmp_path / "run")
    (out / "step_4" / POSITION).unlink()
    assert find_resume_checkpoint("latest", str(out), False) == str(out / "step_2")
    assert f"warning: {out / 'step_4' / POSITION} is missing (a save always writes it, so it was deleted or lost): " \
           f"step_4 is not a complete checkpoint, and --resume latest takes {out / 'step_2'}" in capsys.readouterr().err
    (out / "step_2" / POSITION).unlink()
    with pytest.raises(InputError, match=r"no complete checkpoint in .*run \(step_2, step_4 without position.json\)"):
        choose_checkpoint("latest", str(out), False)


def test_latest_never_picks_an_incomplete_checkpoint(tmp_path):
    from textclf.checkpointing.folders import find_resume_checkpoint

    (tmp_path / "step_10").mkdir()
    (tmp_path / "step_10" / "position.json").write_text("{}")
    (tmp_path / "step_20").mkdir()  # no position.json: not complete
    (tmp_path / ".incomplete_step_30").mkdir()
    assert find_resume_checkpoint("latest", str(tmp_path), False) == str(tmp_path / "step_10")


def test_checkpoint_positions_are_read_without_torch_and_name_accelerate_s_fsdp_folder():

    from accelerate.utils.constants import FSDP_MODEL_NAME

    from textclf.checkpointing.folders import FSDP_SHARDED

    assert FSDP_SHARDED == f"{FSDP_MODEL_NAME}_0"  # written out in checkpointing/, which must not import accelerate
    result = subprocess.run([sys.executable, "-X", "importtime", "-c",
                             "import textclf.checkpointing, textclf.launch, textclf.cli"],
                            cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"torch", "accelerate"} & imported


def test_a_resume_through_a_link_goes_on_in_the_checkpoint_s_real_folder_and_locks_it(tmp_path, accelerator):
    from textclf.checkpointing.folders import find_checkpoint
    from textclf.checkpointing.output_dir import claim_output_dir
    from textclf.checkpointing.plan import config_of
    from textclf.config import TrainConfig

    real = old_run(tmp_path / "run")
    links = tmp_path / "links"
    links.mkdir()
    (links / "last").symlink_to(real / "step_2")
    (links / "run").symlink_to(real)
    for link in (links / "last", links / "run" / "step_2"):  # a link to the checkpoint, or on its way
        path = find_checkpoint(TrainConfig(resume=str(link)))
        assert path == str(real / "step_2")
        output_dir = config_of(path, {"config": {"output_dir": "checkpoints"}})["output_dir"]
        assert output_dir == str(real)
        try:
            claim_output_dir(accelerator, output_dir, str(link), False, path)
            assert (real / ".lock").read_text().startswith(f"pid {os.getpid()} on ")
        finally:
            release_locks_under(tmp_path)
    assert sorted(os.listdir(links)) == ["last", "run"]


@pytest.mark.slow
def test_train_py_resumed_through_a_link_continues_in_the_real_folder(tmp_path, reviews_csv, cache_dir,
                                                                      four_step_run):
    run = shutil.copytree(four_step_run, tmp_path / "run")
    links = tmp_path / "links"
    links.mkdir()
    (links / "last").symlink_to(run / "step_4")
    result = run_train([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", 6, "--save_steps", 2,
                        "--resume", links / "last"])
    assert f"resumed from {run / 'step_4'} at optimizer step 4" in result.stdout
    assert sorted(losses(run)) == [1, 2, 3, 4, 5, 6] and (run / "step_6").is_dir() and (run / "model").is_dir()
    assert os.listdir(links) == ["last"]
