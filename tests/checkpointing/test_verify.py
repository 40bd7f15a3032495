"""A checkpoint verified before anything of it loads (textclf/checkpointing/verify.py): every file against its record,
position.json against its sha256 and this user's signature, edits refused resealed or not, an older textclf's checkpoint
checked as far as it can be, a resume's tokenizer checked before it is read."""

import json
import os
import shutil

import pytest
import torch

from conftest import (
    REPO,
    TINY,
    RunsCode,
    another_user,
    assert_refused,
    losses,
    one_line,
    reseal,
    step_moved,
    train_forked,
)
from textclf.checkpointing.folders import POSITION
from textclf.checkpointing.plan import Start
from textclf.checkpointing.verify import (
    authorship,
    read_position,
    read_verified_position,
    verify_checkpoint,
    verify_files,
)
from textclf.checkpointing.write import (
    SECRET_FILE,
    SIGNATURE,
    own_secret,
    sealed,
)
from textclf.cli import parse_config, plan_run
from textclf.errors import InputError
from textclf.files import sha256
from textclf.models.trained import load_trained

# A file of each kind: the weights, the optimizer's moments, the scheduler, an RNG state, the tokenizer.
FILES = ["model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "tokenizer/tokenizer.json"]


def flip_byte(path, offset=None):
    """One bit of one byte changed, in the middle of the file unless told where: the size stays the same."""
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


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


def edit_position(checkpoint, edit) -> None:
    position = json.loads((checkpoint / POSITION).read_text())
    edit(position)
    (checkpoint / POSITION).write_text(json.dumps(position))


ZOO = REPO / "accelerate_configs"


EDITS = {
    "step": step_moved,
    "seed": lambda position: position["config"].update(seed=7),
    "learning rate": lambda position: position["config"].update(learning_rate=0.5),
    "loss window": lambda position: position["loss_window"][0].update(loss_sum=123.0),
}


def edited(folder, name, four_step_run, signature):
    if name == "weights":
        def edit(position):
            shutil.copy(four_step_run / "step_4" / "model.safetensors", folder / "model.safetensors")
            position["files"]["model.safetensors"] = json.loads((four_step_run / "step_4" / POSITION).read_text())[
                "files"]["model.safetensors"]
    else:
        edit = EDITS[name]
    reseal(folder, edit, signature)
    return folder


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory, reviews_csv, cache_dir):
    """A ZeRO-2 run on 2 processes, 4 optimizer steps, checkpoints step_2/ and step_4/."""
    out = tmp_path_factory.mktemp("zero2")
    train_forked([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", 4, "--save_steps", 2,
                  "--eval_strategy", "no", "--output_dir", out], config_file=ZOO / "zero2.yaml")
    return out


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


@pytest.mark.parametrize("signature", ["kept", "removed"])
@pytest.mark.parametrize("name", [*EDITS, "weights"])
def test_a_resealed_edit_is_refused_before_anything_loads(step_2, four_step_run, name, signature, capsys):
    """What a hand edit resealed with position.json's own sha256 used to train on silently: refused in one line by
    the plan, before torch is imported in train.py, whether the signature was left in place or removed."""
    edited(step_2, name, four_step_run, signature)
    argv = ["--resume", str(step_2), "--output_dir", str(step_2.parent / "out")]
    with pytest.raises(InputError) as refused:
        plan_run(parse_config(argv), argv)
    lines = str(refused.value).splitlines()
    expected = {"kept": "its position.json is not what this user's run signed (its signature does not verify): it "
                        "was edited; use another checkpoint",
                "removed": "its position.json records signed_by, as only this textclf writes, yet no signature"}
    assert len(lines) == 1 and lines[0].startswith(f"cannot load checkpoint {step_2}: {expected[signature]}"), lines
    assert not (step_2.parent / "out").exists()


def test_who_wrote_a_checkpoint_is_judged_by_its_signature(step_2, tmp_path):
    position = read_verified_position(str(step_2))
    assert authorship(str(step_2), position) is None  # this user's run
    with another_user(tmp_path):
        assert authorship(str(step_2), position).startswith("it was signed with another secret than this user's")
    with another_user(tmp_path):
        os.environ[SECRET_FILE] = str(tmp_path / "none_here")
        assert authorship(str(step_2), position).startswith("this machine has no secret to check its signature with")
    reseal(step_2, lambda position: None, signature="stripped")
    assert authorship(str(step_2), read_verified_position(str(step_2))).startswith("it is not signed")
    assert sealed({"step": 1}, own_secret())[SIGNATURE] != sealed({"step": 2}, own_secret())[SIGNATURE]


def test_an_edit_that_drops_or_garbles_the_signature_s_parts_is_refused_in_one_line(step_2):
    """A signature kept without the id of its secret is an edit, not another user's checkpoint; a signature or a
    field that is not the text this code writes (non-ASCII, a lone surrogate) is one line, never a crash."""
    edits = {
        "signed_by removed": lambda position: position.pop("signed_by"),
        "signed_by garbled": lambda position: position.update(signed_by=["not", "an", "id"]),
        "a non-ASCII signature": lambda position: position.update(signature="é" * 64),
        "a lone surrogate": lambda position: position["config"].update(run_name="\udc80"),
    }
    for what, edit in edits.items():
        checkpoint = shutil.copytree(step_2, step_2.parent / what.replace(" ", "_"))
        reseal(checkpoint, edit)
        position = read_verified_position(str(checkpoint))
        with pytest.raises(InputError) as refused:
            authorship(str(checkpoint), position)
        assert one_line(refused).startswith(f"cannot load checkpoint {checkpoint}: its {POSITION} "), what
        assert "it was edited" in one_line(refused), what


def test_every_loader_refuses_a_file_the_checkpoint_did_not_record_or_a_record_outside_it(step_2, tmp_path):
    """export, predict and report find the weights and the tokenizer's files by name: an added one (a
    model.safetensors beside DeepSpeed's shards would be taken first) is refused, as is a record that names a path
    outside the checkpoint or a link (a device behind it would be hashed forever)."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"x")
    cases = {
        "an added file": lambda c: ((c / "tokenizer" / "added_tokens.json").write_text("{}"),
                                    "tokenizer/added_tokens.json is not among the files it recorded"),
        "an absolute record": lambda c: (reseal(c, lambda p: p["files"].update({str(outside): {"size": 1}})),
                                         f"{outside} is not a path inside the checkpoint"),
        "a record up and out": lambda c: (reseal(c, lambda p: p["files"].update({"../outside": {"size": 1}})),
                                          "../outside is not a path inside the checkpoint"),
        "a link": lambda c: ((c / "zeros").symlink_to("/dev/zero"),
                             reseal(c, lambda p: p["files"].update({"zeros": {"size": 0, "sha256": "0" * 64}})),
                             "zeros is not a regular file")[1:],
    }
    for what, make in cases.items():
        checkpoint = shutil.copytree(step_2, tmp_path / what.replace(" ", "_"))
        _, expected = make(checkpoint)
        with another_user(tmp_path):  # no signature can vouch for it: what a checkpoint from elsewhere meets
            with pytest.raises(InputError) as refused:
                load_trained(str(checkpoint))
        assert one_line(refused).startswith(f"cannot load checkpoint {checkpoint}: {expected}"), what
        assert one_line(refused).endswith("; use another checkpoint"), what
    # A folder replaced by a link to a copy with one file more: the walk does not follow the link, the check does.
    linked = shutil.copytree(step_2, tmp_path / "a_linked_folder")
    elsewhere = shutil.move(linked / "tokenizer", tmp_path / "tokenizer_elsewhere")
    (elsewhere / "added_tokens.json").write_text("{}")
    (linked / "tokenizer").symlink_to(elsewhere)
    with another_user(tmp_path), pytest.raises(InputError) as refused:
        load_trained(str(linked))
    assert str(refused.value).startswith(f"cannot load checkpoint {linked}: tokenizer/"), str(refused.value)
    assert all("is reached through a link" in line for line in str(refused.value).splitlines())


@pytest.mark.slow
def test_zero2_edits_planted_pickles_and_another_user(zero2_run, tmp_path):
    """Under zero2.yaml: a resealed edit of the seed trains nothing; a partition replaced by a pickle that would run
    code, its record made to match, is refused whether the checkpoint counts as this user's (its signature no longer
    verifies) or as from elsewhere (its pickles read weights-only); another user resumes it, said in one line, bit
    for bit."""
    def resume(checkpoint, out, env=None):
        return train_forked(["--resume", checkpoint, "--output_dir", out], config_file=ZOO / "zero2.yaml",
                            check=False, env=env)

    def errors(result):
        return [line for line in result.stderr.splitlines() if line.startswith("error:")]

    seed = shutil.copytree(zero2_run / "step_2", tmp_path / "seed")
    reseal(seed, EDITS["seed"])
    result = resume(seed, tmp_path / "out")
    assert result.returncode != 0 and errors(result) == [
        f"error: cannot load checkpoint {seed}: its position.json is not what this user's run signed (its "
        "signature does not verify): it was edited; use another checkpoint"], result.stderr[-3000:]
    assert not (tmp_path / "out").exists()

    marker = tmp_path / "code-ran"
    partition = "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    for signature in ("kept", "stripped"):
        planted = shutil.copytree(zero2_run / "step_2", tmp_path / f"planted_{signature}")
        torch.save({"optimizer_state_dict": RunsCode(str(marker))}, planted / partition)

        def record(position, planted=planted):
            position["files"][partition] = {"size": (planted / partition).stat().st_size,
                                            "sha256": sha256(planted / partition)}
        reseal(planted, record, signature)
        result = resume(planted, tmp_path / "out")
        said = errors(result)
        assert result.returncode != 0 and len(said) == 1, result.stderr[-3000:]
        assert ("signature does not verify" if signature == "kept" else "holds more than tensors") in said[0], said
        assert not marker.exists() and not (tmp_path / "out" / "log.jsonl").exists()  # no step trained

    with another_user(tmp_path) as env:
        result = resume(zero2_run / "step_2", tmp_path / "elsewhere", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: nothing proves that this user's runs wrote" in result.stderr
    assert {step: loss for step, loss in losses(zero2_run).items() if step > 2} == losses(tmp_path / "elsewhere")
