"""What a run writes, and where, when links and misplaced inputs are around it: no link followed at a tracker's
folder, an --overwrite_output_dir that never moves what the run reads, a resume through a link that goes on in the
checkpoint's real folder, an exported folder whose files read alike, and no empty folder left by a failed command
(docs/faults.md)."""

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import TINY, assert_refused, losses, run_train, untouched


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


# --- A tracker's folder ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("run_name", [None, "first"], ids=["tensorboard", "tensorboard/<run_name>"])
def test_a_link_at_a_tracker_s_folder_is_removed_not_written_through(tmp_path, victim, run_name):
    """The trackers started as train.py starts them: log_with's Accelerator, then init_trackers."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from textclf import loop
    from textclf.config import TrainConfig

    out = tmp_path / "out"
    linked = out / "tensorboard" / run_name if run_name else out / "tensorboard"
    linked.parent.mkdir(parents=True)
    linked.symlink_to(victim)
    cfg = TrainConfig(output_dir=str(out), report_to=["tensorboard"], run_name=run_name)
    try:
        accelerator = Accelerator(cpu=True, log_with=loop.log_with(cfg), project_dir=cfg.output_dir)
        accelerator.init_trackers(cfg.project_name, **loop.tracker_config(cfg))
        accelerator.log({"loss": 0.5}, step=1)
        accelerator.end_training()
    finally:
        AcceleratorState._reset_state(True)
    assert untouched(victim)
    assert not linked.is_symlink() and any(name.startswith("events.out.tfevents") for name in os.listdir(linked))


def test_the_folders_of_the_trackers_named_are_those_inside_the_output_folder(tmp_path, monkeypatch):
    from textclf.loop.tracking import named_trackers, tracker_folders

    out = str(tmp_path / "out")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    assert tracker_folders(named_trackers(["tensorboard", "wandb", "aim", "mlflow"], out, run_name="r"), out) == (
        os.path.join("tensorboard", "r"), "wandb", ".aim")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    assert tracker_folders(named_trackers(["wandb"], out), out) == ()
    assert tracker_folders(named_trackers(["tensorboard"], out, run_name=str(tmp_path / "abs")), out) == ()


# --- --overwrite_output_dir never moves what the run reads ----------------------------------------------------

def old_run(out: Path) -> Path:
    """A previous run's folder: a checkpoint and its log."""
    (out / "step_2").mkdir(parents=True)
    (out / "step_2" / "position.json").write_text("{}")
    (out / "log.jsonl").write_text('{"step": 1}\n')
    return out


def listing(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


@pytest.mark.parametrize("inside", ["--data", "--eval_data", "--model"])
def test_overwrite_output_dir_is_refused_where_the_folder_holds_what_the_run_reads(tmp_path, reviews_csv, inside,
                                                                                   tiny_model):
    from textclf.cli import parse_config, plan_run
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


# --- A resume through a link ---------------------------------------------------------------------------------

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


# --- The exported folder's modes --------------------------------------------------------------------------------

def test_the_exported_files_all_get_the_mode_of_a_new_file(tmp_path, tiny_model):
    from textclf.models.folder import load_model_folder, save_verified

    model, tokenizer = load_model_folder(str(tiny_model))
    mask = os.umask(0o022)
    try:
        target = save_verified(model, tokenizer, str(tmp_path / "model"), training={"config": {}})
    finally:
        os.umask(mask)
    modes = {name: oct(os.stat(os.path.join(target, name)).st_mode & 0o777) for name in os.listdir(target)}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes


def test_usual_modes_leave_links_and_what_they_point_at_alone(tmp_path, victim):
    from textclf.files import give_usual_modes

    (victim / "file").chmod(0o600)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "weights").write_text("w")
    (tmp_path / "out" / "weights").chmod(0o600)
    (tmp_path / "out" / "link").symlink_to(victim / "file")
    mask = os.umask(0o027)
    try:
        give_usual_modes(str(tmp_path / "out"))
    finally:
        os.umask(mask)
    assert (tmp_path / "out" / "weights").stat().st_mode & 0o777 == 0o640
    assert (victim / "file").stat().st_mode & 0o777 == 0o600


# --- No empty folder left by a failed command ----------------------------------------------------------------

def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


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


def test_a_report_that_fails_to_write_leaves_no_empty_folder(tmp_path, tiny_model, reviews_csv, monkeypatch):
    from textclf import report
    from textclf.errors import InputError, write_failed

    def failing(path, obj, *args):
        raise write_failed("write", path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "free space")

    monkeypatch.setattr(report, "write_json", failing)
    out = tmp_path / "reports" / "first"
    with pytest.raises(InputError, match="No space left on device"):
        report.main(list(map(str, ["--model", tiny_model, "--file", reviews_csv, "--output_dir", out,
                                   "--no_baseline"])))
    assert os.listdir(tmp_path) == []


def test_make_folders_says_which_it_made(tmp_path):
    from textclf.files import make_folders, remove_empty

    (tmp_path / "a").mkdir()
    made = make_folders(str(tmp_path / "a" / "b" / "c"))
    assert made == [str(tmp_path / "a" / "b" / "c"), str(tmp_path / "a" / "b")]
    (tmp_path / "a" / "b" / "kept").write_text("")
    remove_empty(made)
    assert sorted(os.listdir(tmp_path / "a" / "b")) == ["kept"]
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError):
        make_folders(str(tmp_path / "file"))
