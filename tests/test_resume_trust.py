"""What a resume trusts of its checkpoint: the tokenizer it saved, verified before it loads, whatever --cache_dir
holds (a requeued job on another node starts with an empty cache, and a tokenizer learnt again is not always the
same vocabulary); and position.json's own sha256, which deleting it does not switch off."""

import json
import shutil

import pytest
from test_integrity import as_an_older_textclf_wrote_it
from test_resume import assert_same_run

from conftest import TINY, assert_refused, one_line, train_forked
from textclf.checkpointing.folders import POSITION
from textclf.checkpointing.plan import Start
from textclf.checkpointing.verify import read_verified_position
from textclf.checkpointing.write import own_secret, sealed
from textclf.errors import InputError

LEARNT = "data: learnt a tokenizer"


def says_checkpoint_tokenizer(output: str, checkpoint) -> bool:
    """Whether the run said it took the tokenizer `checkpoint` saved."""
    return any(line.startswith("data: the tokenizer of ") and
               line.endswith(f"tokens that the checkpoint was trained with, from {checkpoint / 'tokenizer'}")
               for line in output.splitlines())


@pytest.fixture
def step_2(tmp_path, four_step_run):
    return shutil.copytree(four_step_run / "step_2", tmp_path / "step_2")


def edit_position(checkpoint, edit) -> None:
    position = json.loads((checkpoint / POSITION).read_text())
    edit(position)
    (checkpoint / POSITION).write_text(json.dumps(position))


# --- The checkpoint's tokenizer: verified before it loads ---------------------------------------------------------

def test_a_resume_s_tokenizer_folder_is_verified_before_it_is_used(step_2):
    """Every file of step_<N>/tokenizer/ against position.json's record: changed, unrecorded (a loader reads every
    file of the folder), or gone from the record; a fresh run has none."""
    assert Start().verified_folder("tokenizer") is None
    start = Start(checkpoint=str(step_2))
    assert start.verified_folder("tokenizer") == str(step_2 / "tokenizer")

    saved = (step_2 / "tokenizer" / "tokenizer.json").read_bytes()
    (step_2 / "tokenizer" / "tokenizer.json").write_bytes(saved.replace(b'"[UNK]": 1', b'"[UNK]": 2', 1))
    assert saved != (step_2 / "tokenizer" / "tokenizer.json").read_bytes()
    with pytest.raises(InputError) as refused:
        start.verified_folder("tokenizer")
    assert one_line(refused) == (f"cannot resume from {step_2}: tokenizer/tokenizer.json is not the file that was "
                                 "saved (its sha256 differs); resume from another checkpoint "
                                 "(--resume <output_dir>/step_<N>)")
    (step_2 / "tokenizer" / "tokenizer.json").write_bytes(saved)

    (step_2 / "tokenizer" / "added_tokens.json").write_text('{"[NEW]": 0}')
    with pytest.raises(InputError) as refused:
        start.verified_folder("tokenizer")
    assert one_line(refused).startswith(f"cannot resume from {step_2}: tokenizer/added_tokens.json is not among the "
                                        "files it recorded")
    (step_2 / "tokenizer" / "added_tokens.json").unlink()

    def unrecord_tokenizer(position):
        position["files"] = {name: entry for name, entry in position["files"].items()
                             if not name.startswith("tokenizer/")}

    position = json.loads((step_2 / POSITION).read_text())
    unrecord_tokenizer(position)
    (step_2 / POSITION).write_text(json.dumps(sealed(position, own_secret())))  # even signed
    with pytest.raises(InputError) as refused:
        start.verified_folder("tokenizer")
    assert one_line(refused).startswith(f"cannot resume from {step_2}: its {POSITION} records no tokenizer/ folder")


def test_get_tokenizer_takes_the_saved_one_and_learns_nothing(step_2, tmp_path, capsys):
    from textclf.models.tokenizer import get_tokenizer

    empty = tmp_path / "empty_cache"
    tokenizer = get_tokenizer("scratch-tiny", iter(["unused"]), str(empty), "key", 32,
                              saved_in=str(step_2 / "tokenizer"))
    assert says_checkpoint_tokenizer(capsys.readouterr().out, step_2)
    assert not empty.exists()
    saved = json.loads((step_2 / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(tokenizer) == len(saved) and tokenizer.convert_tokens_to_ids(list(saved)) == list(saved.values())


@pytest.mark.slow
def test_a_resume_with_an_empty_cache_trains_with_its_checkpoint_s_tokenizer_bitwise(tmp_path, reviews_csv,
                                                                                      cache_dir):
    """A requeued job on another node: its --cache_dir is empty. It learns no tokenizer, and ends as the run that
    was not interrupted."""
    run = [*TINY, "--data", reviews_csv, "--max_steps", 6, "--save_steps", 3]
    train_forked([*run, "--cache_dir", cache_dir, "--output_dir", tmp_path / "full"], config_file=None)
    checkpoint = tmp_path / "full" / "step_3"
    empty = tmp_path / "empty_cache"
    resumed = train_forked([*run, "--cache_dir", empty, "--output_dir", tmp_path / "resumed", "--resume", checkpoint],
                           config_file=None)
    assert LEARNT not in resumed.stdout and says_checkpoint_tokenizer(resumed.stdout, checkpoint), resumed.stdout
    assert not list(empty.glob("tokenizer-*"))
    assert_same_run(tmp_path / "full", tmp_path / "resumed", 3)


@pytest.mark.slow
def test_a_lora_resume_takes_its_checkpoint_s_tokenizer_even_once_the_model_s_own_is_gone(tmp_path, reviews_csv,
                                                                                         family_model):
    """A pretrained model's tokenizer is saved in the checkpoint too, and that is the one the run was trained with:
    the resume takes it (here the model's folder has lost its tokenizer meanwhile) and ends as the uninterrupted
    run, adapters and all."""
    base = shutil.copytree(family_model("bert"), tmp_path / "base")
    run = ["--model", base, "--lora", "--max_length", "32", "--per_device_train_batch_size", "8", "--logging_steps",
           "1", "--report_to", "none", "--data", reviews_csv, "--cache_dir", tmp_path / "cache", "--max_steps", 4,
           "--save_steps", 2]
    train_forked([*run, "--output_dir", tmp_path / "full"], config_file=None)
    for path in base.iterdir():
        if "token" in path.name or path.name == "vocab.txt":
            path.unlink()
    checkpoint = tmp_path / "full" / "step_2"
    resumed = train_forked([*run, "--output_dir", tmp_path / "resumed", "--resume", checkpoint], config_file=None)
    assert says_checkpoint_tokenizer(resumed.stdout, checkpoint), resumed.stdout
    assert_same_run(tmp_path / "full", tmp_path / "resumed", 2)


@pytest.mark.slow
def test_a_checkpoint_whose_tokenizer_is_not_as_saved_is_refused_before_any_is_learnt(tmp_path, four_step_run,
                                                                                       reviews_csv):
    out = shutil.copytree(four_step_run, tmp_path / "run")
    vocab = out / "step_2" / "tokenizer" / "tokenizer.json"
    vocab.write_bytes(vocab.read_bytes().replace(b'"[UNK]": 1', b'"[UNK]": 2', 1))
    empty = tmp_path / "empty_cache"
    result = train_forked([*TINY, "--data", reviews_csv, "--cache_dir", empty, "--max_steps", 4, "--output_dir",
                           tmp_path / "resumed", "--resume", out / "step_2"], config_file=None, check=False)
    assert_refused(result, f"cannot resume from {out / 'step_2'}: tokenizer/tokenizer.json is not the file that was "
                           "saved (its sha256 differs)")
    assert LEARNT not in result.stdout and not list(empty.glob("tokenizer-*"))
    assert not (tmp_path / "resumed" / "log.jsonl").exists()


# --- position.json's own sha256 -----------------------------------------------------------------------------------

def test_a_position_whose_sha256_was_deleted_is_refused_not_taken_for_an_older_one(step_2):
    def moved_on(position):
        del position["sha256"]
        position["step"] = 3

    edit_position(step_2, moved_on)
    with pytest.raises(InputError) as refused:
        read_verified_position(str(step_2))
    assert one_line(refused) == (
        f"cannot load checkpoint {step_2}: its {POSITION} has no sha256 of its own, yet no older textclf wrote it (it "
        "records global_batch_size): its sha256 was deleted, and none of its fields can be trusted; use another "
        "checkpoint")


@pytest.mark.parametrize("name, hashed", [("scheduler.bin", False), ("model.safetensors", True)],
                         ids=["a small file unhashed", "a large file hashed"])
def test_an_unsealed_position_whose_files_are_recorded_as_no_older_textclf_did_is_refused(step_2, monkeypatch,
                                                                                         name, hashed):
    """Deleting global_batch_size too does not pass a position off as an older one while its record of files is
    not an older textclf's: a sha256 for each file up to its limit, none above (the limit lowered here to 1 MiB, so
    that a tiny checkpoint has files on both sides of it)."""
    monkeypatch.setattr("textclf.checkpointing.verify.OLDER_HASHED_UP_TO", 2 ** 20)
    as_an_older_textclf_wrote_it(step_2, hashed_up_to=2 ** 20)
    read_verified_position(str(step_2))  # as an older textclf wrote it: no sha256 to check

    def out_of_rule(position):
        if hashed:
            position["files"][name]["sha256"] = "0" * 64
        else:
            del position["files"][name]["sha256"]

    edit_position(step_2, out_of_rule)
    size = json.loads((step_2 / POSITION).read_text())["files"][name]["size"]
    with pytest.raises(InputError) as refused:
        read_verified_position(str(step_2))
    why = f"a sha256 for {name}, of {size} bytes, above 1 MiB" if hashed else \
        f"no sha256 for {name}, of {size} bytes, 1 MiB or less"
    assert f"yet no older textclf wrote it (it records {why}): its sha256 was deleted" in one_line(refused)


@pytest.mark.slow
def test_a_resume_from_a_position_with_its_sha256_deleted_and_its_step_edited_is_one_line(tmp_path, four_step_run,
                                                                                         reviews_csv, cache_dir):
    checkpoint = shutil.copytree(four_step_run / "step_2", tmp_path / "step_2")

    def moved_on(position):
        del position["sha256"]
        position["step"], position["batch_in_epoch"] = 3, 3

    edit_position(checkpoint, moved_on)
    result = train_forked([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", 4, "--output_dir",
                           tmp_path / "resumed", "--resume", checkpoint], config_file=None, check=False)
    assert_refused(result, f"cannot load checkpoint {checkpoint}: its {POSITION} has no sha256 of its own, yet no "
                           "older textclf wrote it")
    assert "older textclf, which" not in result.stderr and "resumed from" not in result.stdout
    assert not (tmp_path / "resumed").exists() or not list((tmp_path / "resumed").iterdir())
