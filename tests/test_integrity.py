"""Checkpoint integrity: every file of a checkpoint, position.json included, is read in full against what
was recorded when it was completed, before resume, the best model's reload, export, predict or report
loads any of it (docs/checkpoints.md, docs/faults.md)."""

import json
import shutil

import pytest

from conftest import one_line
from textclf.checkpointing.folders import POSITION
from textclf.checkpointing.verify import read_position, read_verified_position, verify_checkpoint, verify_files
from textclf.checkpointing.write import own_secret, sealed
from textclf.errors import InputError
from textclf.models.trained import load_trained

# A file of each kind: the weights, the optimizer's moments, the scheduler, an RNG state, the tokenizer.
FILES = ["model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "tokenizer/tokenizer.json"]


@pytest.fixture
def step_2(tmp_path, four_step_run):
    return shutil.copytree(four_step_run / "step_2", tmp_path / "step_2")


def flip_byte(path, offset=None):
    """One bit of one byte changed, in the middle of the file unless told where: the size stays the same."""
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_file_is_recorded_with_its_sha256_and_position_json_with_its_own(step_2):
    position = json.loads((step_2 / POSITION).read_text())
    on_disk = sorted(str(path.relative_to(step_2)) for path in step_2.rglob("*") if path.is_file())
    assert sorted(position["files"]) == sorted(set(on_disk) - {POSITION})
    assert all(len(entry["sha256"]) == 64 for entry in position["files"].values())
    assert sealed(position, own_secret()) == position  # signed with this user's secret, then sealed


@pytest.mark.parametrize("name", FILES)
def test_a_flipped_byte_in_any_file_is_one_line_naming_it_for_resume_and_every_loader(step_2, name):
    flip_byte(step_2 / name)
    position = read_verified_position(str(step_2))
    with pytest.raises(InputError) as refused:
        verify_files(str(step_2), position)
    assert one_line(refused) == (f"cannot resume from {step_2}: {name} is not the file that was saved (its sha256 "
                                 "differs); resume from another checkpoint (--resume <output_dir>/step_<N>)")
    with pytest.raises(InputError) as refused:  # export, predict and report load through load_trained
        load_trained(str(step_2))
    assert one_line(refused) == (f"cannot load checkpoint {step_2}: {name} is not the file that was saved (its "
                                 "sha256 differs); use another checkpoint")


def test_a_truncated_weights_file_is_one_line_not_a_safetensors_traceback(step_2):
    weights = step_2 / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(InputError) as refused:
        load_trained(str(step_2))
    assert "model.safetensors has 1000 bytes, " in one_line(refused)


def test_a_changed_value_in_position_json_is_refused_by_its_own_sha256(step_2, tmp_path):
    text = (step_2 / POSITION).read_text()
    # One byte of a value (a hex digit of the data's fingerprint): still JSON, another position.
    flip_byte(step_2 / POSITION, text.index('"data_fingerprint": "') + len('"data_fingerprint": "'))
    with pytest.raises(InputError) as refused:
        read_verified_position(str(step_2))
    assert one_line(refused) == (f"cannot load checkpoint {step_2}: {POSITION} is not the file that was saved (its "
                                 "sha256 differs); use another checkpoint")
    with pytest.raises(InputError, match="position.json is not the file that was saved"):
        load_trained(str(step_2))
    read_position(str(step_2))  # rotation and `latest` still read it: they load nothing


def test_a_flipped_byte_that_breaks_position_json_names_it(step_2):
    flip_byte(step_2 / POSITION, (step_2 / POSITION).read_text().index("{"))  # `{` becomes `z`
    with pytest.raises(InputError) as refused:
        load_trained(str(step_2))
    assert one_line(refused).startswith(f"{step_2 / POSITION} is unreadable")


def test_the_best_model_s_reload_checks_the_checkpoint_first(step_2, tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from textclf.checkpointing.verify import verified_best_checkpoint

    flip_byte(step_2 / "model.safetensors")
    best = {"step": 2, "checkpoint": str(step_2), "metrics": {"eval_f1": 0.5}}
    try:
        with pytest.raises(InputError) as refused:
            with verified_best_checkpoint(Accelerator(cpu=True), best, output_dir=str(tmp_path), allow_pickle=False):
                pass
    finally:
        AcceleratorState._reset_state(True)
    assert one_line(refused).startswith(f"cannot load checkpoint {step_2}: model.safetensors is not the file")


def as_an_older_textclf_wrote_it(folder, hashed_up_to):
    """position.json as textclf wrote it before every file was hashed: no sha256 of its own, none for files above
    `hashed_up_to` bytes (16 MiB then: a test on a tiny checkpoint lowers verify.OLDER_HASHED_UP_TO to match), and
    no global_batch_size, which positions record only since they are sealed."""
    position = json.loads((folder / POSITION).read_text())
    del position["sha256"], position["global_batch_size"]
    for entry in position["files"].values():
        if entry["size"] > hashed_up_to:
            del entry["sha256"]
    (folder / POSITION).write_text(json.dumps(position))


def test_an_older_checkpoint_is_verified_as_far_as_it_can_be_and_says_what_was_not(step_2, capsys, monkeypatch):
    monkeypatch.setattr("textclf.checkpointing.verify.OLDER_HASHED_UP_TO", 2 ** 20)
    as_an_older_textclf_wrote_it(step_2, hashed_up_to=2 ** 20)  # the weights and the optimizer unhashed
    verify_files(str(step_2), read_verified_position(str(step_2)))
    warning = capsys.readouterr().err
    assert f"warning: {step_2} was written by an older textclf, which recorded no sha256 for model.safetensors, " \
           f"optimizer.bin or for its {POSITION}: those are checked by their size alone" in warning
    flip_byte(step_2 / "scheduler.bin")  # what it did hash is still checked
    with pytest.raises(InputError, match="scheduler.bin is not the file that was saved"):
        verify_checkpoint(str(step_2), read_verified_position(str(step_2)))


def test_a_new_checkpoint_whose_record_lost_a_sha256_is_refused(step_2):
    position = json.loads((step_2 / POSITION).read_text())
    del position["files"]["optimizer.bin"]["sha256"]
    (step_2 / POSITION).write_text(json.dumps(sealed(position, own_secret())))  # even signed
    with pytest.raises(InputError, match="optimizer.bin is not the file that was saved"):
        verify_checkpoint(str(step_2), read_verified_position(str(step_2)))


# --- What the run says when a checkpoint's position.json is gone, or a write fails before any checkpoint ---

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


def test_a_failed_log_write_advises_resume_only_when_a_checkpoint_exists(tmp_path):
    from textclf.loop.tracking import LOG, JsonLinesTracker

    (tmp_path / LOG).mkdir()  # the log cannot be appended to, as on a full disk
    with pytest.raises(InputError) as refused:
        JsonLinesTracker(str(tmp_path)).log({"loss": 0.5}, step=1)
    assert one_line(refused).endswith("and start again: no checkpoint was completed yet")
    assert "--resume" not in str(refused.value)
    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_2" / POSITION).write_text("{}")
    with pytest.raises(InputError, match=r"then continue with --resume latest \(the newest complete checkpoint, "
                                         r".*step_2, is untouched\)"):
        JsonLinesTracker(str(tmp_path)).log({"loss": 0.5}, step=3)
