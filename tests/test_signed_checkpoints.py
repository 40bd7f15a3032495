"""A run's own checkpoints prove they are its own: position.json is signed with the user's secret, so a resume needs
no flag for what the run wrote, and an edit, resealed with a new sha256 or not, never trains (docs/checkpoints.md,
docs/faults.md)."""

import json
import os
import pickle
import shutil
import stat

import pytest
import torch

from conftest import REPO, TINY, RunsCode, another_user, losses, train_forked
from textclf.checkpointing.folders import POSITION
from textclf.checkpointing.load import refuse_other_counts
from textclf.checkpointing.pickles import FORCE_WEIGHTS_ONLY, weights_only_loads
from textclf.checkpointing.plan import seen_from_here
from textclf.checkpointing.verify import authorship, read_verified_position
from textclf.checkpointing.write import (
    SECRET_FILE,
    SIGNATURE,
    SIGNED_FORMAT,
    own_secret,
    own_sha256,
    read_secret,
    sealed,
    secret_path,
)
from textclf.cli import parse_config, plan_run
from textclf.errors import InputError
from textclf.files import sha256

ZOO = REPO / "accelerate_configs"

# --- the secret ---


def test_the_secret_is_made_at_first_use_private_and_then_kept(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_FILE)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    assert secret_path() == str(tmp_path / "home" / ".config" / "textclf" / "checkpoint_secret")
    assert read_secret() is None  # reading makes nothing
    secret = own_secret()
    assert len(secret) == 32 and read_secret() == secret == own_secret()
    assert stat.S_IMODE(os.stat(secret_path()).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(secret_path())).st_mode) == 0o700
    assert os.listdir(os.path.dirname(secret_path())) == ["checkpoint_secret"]  # no temporary file left
    monkeypatch.setenv(SECRET_FILE, str(tmp_path / "cluster" / "secret"))  # where a cluster shares it
    assert secret_path() == str(tmp_path / "cluster" / "secret") and own_secret() != secret


def test_a_secret_that_cannot_be_made_or_used_is_one_line_naming_the_variable(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(SECRET_FILE, str(tmp_path / "a_file" / "secret"))
    with pytest.raises(InputError, match=f"cannot make .* set {SECRET_FILE} to a file path this user can write"):
        own_secret()
    (tmp_path / "short").write_bytes(b"12345")
    monkeypatch.setenv(SECRET_FILE, str(tmp_path / "short"))
    with pytest.raises(InputError, match=f"holds 5 bytes, fewer than 32: delete it .* {SECRET_FILE}"):
        own_secret()


# --- what a signature proves ---


@pytest.fixture
def step_2(tmp_path, four_step_run):
    return shutil.copytree(four_step_run / "step_2", tmp_path / "step_2")


def reseal(folder, edit, signature="kept"):
    """Edit position.json as one without the secret would: the change made, then its own sha256 made again. The
    signature is kept as it was, removed, or removed with all that this textclf writes beside it ("stripped": the
    position of an older textclf)."""
    position = json.loads((folder / POSITION).read_text())
    edit(position)
    dropped = {"kept": (), "removed": (SIGNATURE,), "stripped": (SIGNATURE, *SIGNED_FORMAT)}[signature]
    position = {key: value for key, value in position.items() if key not in dropped}
    (folder / POSITION).write_text(json.dumps({**position, "sha256": own_sha256(position)}))


def step_moved(position):
    position["step"] += 1
    position["batch_in_epoch"] += 1


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


# --- pickles ---


@pytest.mark.parametrize("pickled_by", ["torch.save", "pickle.dump"])
def test_a_pickle_that_would_run_code_is_one_line_and_never_runs(tmp_path, pickled_by):
    """DeepSpeed's own torch.load(..., weights_only=False) is read weights-only under weights_only_loads, which puts
    torch's switch back as it was."""
    marker, path = tmp_path / "code-ran", tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    if pickled_by == "torch.save":
        torch.save({"optimizer_state_dict": RunsCode(str(marker))}, path)
    else:
        path.write_bytes(pickle.dumps({"optimizer_state_dict": RunsCode(str(marker))}))
    assert FORCE_WEIGHTS_ONLY not in os.environ
    with pytest.raises(InputError) as refused:
        with weights_only_loads("step_6", deepspeed=True):
            torch.load(path, weights_only=False)
    assert str(refused.value).startswith("cannot load checkpoint step_6: a file of it holds more than tensors and "
                                         "the classes its writer pickles (Unsupported ")
    assert "pass --allow_pickle if you trust whoever wrote it" in str(refused.value)
    assert not marker.exists() and FORCE_WEIGHTS_ONLY not in os.environ


def test_deepspeed_s_own_classes_read_weights_only():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {"loss_scaler": LossScaler(1.0), "dynamic": DynamicLossScaler(2 ** 16, 1000, 1, False, False),
             "zero_stage": ZeroStageEnum.gradients, "param_slice_mappings": [{"w": fragment_address(4, 0)}],
             "tensor": torch.ones(2)}
    path = "/dev/shm/textclf-deepspeed-classes.pt" if os.path.isdir("/dev/shm") else "deepspeed-classes.pt"
    torch.save(state, path)
    try:
        with weights_only_loads("step_6", deepspeed=True):
            loaded = torch.load(path, weights_only=False)
    finally:
        os.remove(path)
    assert loaded["zero_stage"] is ZeroStageEnum.gradients and loaded["dynamic"].cur_scale == 2 ** 16
    assert loaded["param_slice_mappings"][0]["w"] == fragment_address(4, 0)


# --- what needs no secret ---


def test_a_position_moved_without_its_states_is_refused_once_they_load(tmp_path):
    """The step position.json records, against the scheduler's and the optimizer's own counts (a checkpoint from
    elsewhere has nothing else to be checked by)."""
    from types import SimpleNamespace

    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight])
    for _ in range(3):
        weight.grad = torch.ones(2)
        optimizer.step()
    scheduler = SimpleNamespace(scheduler=SimpleNamespace(last_epoch=3))  # accelerate's wrapper
    refuse_other_counts("step_3", {"step": 3}, scheduler, optimizer)
    with pytest.raises(InputError, match=r"^cannot resume from step_4: its position.json says step 4, but its "
                                         r"scheduler has stepped 3 times and its optimizer has taken 3 steps"):
        refuse_other_counts("step_4", {"step": 4}, scheduler, optimizer)
    # fp16's loss scaler skips steps: the optimizer may count fewer, never more.
    refuse_other_counts("step_3", {"step": 3, "mixed_precision": "fp16"},
                        SimpleNamespace(last_epoch=3), torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))


def test_a_checkpoint_s_relative_paths_start_where_its_run_started(tmp_path, monkeypatch):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "d.csv").write_text("label,review\n")
    position = {"started_in": str(tmp_path / "project"), "model": "scratch-tiny",
                "config": {"data": "d.csv", "eval_data": "gone.csv", "model": "scratch-tiny", "seed": 1,
                           "cache_dir": "~/.cache/textclf"}}
    monkeypatch.chdir(tmp_path)
    seen = seen_from_here(position)
    assert seen["config"] == {**position["config"], "data": str(tmp_path / "project" / "d.csv")}
    monkeypatch.chdir(tmp_path / "project")
    assert seen_from_here(position) is position


# --- train.py ---


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory, reviews_csv, cache_dir):
    """A ZeRO-2 run on 2 processes, 4 optimizer steps, checkpoints step_2/ and step_4/."""
    out = tmp_path_factory.mktemp("zero2")
    train_forked([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", 4, "--save_steps", 2,
                  "--eval_strategy", "no", "--output_dir", out], config_file=ZOO / "zero2.yaml")
    return out


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


@pytest.mark.slow
def test_a_foreign_checkpoint_s_step_is_checked_against_its_scheduler(tmp_path, four_step_run):
    """An older textclf's checkpoint (no signature) with its step moved: nothing proves who wrote it, and its
    scheduler's count refuses it once loaded, before any step."""
    step_2 = shutil.copytree(four_step_run / "step_2", tmp_path / "step_2")
    reseal(step_2, step_moved, signature="stripped")
    result = train_forked(["--resume", step_2, "--output_dir", tmp_path / "out", "--max_steps", 4], config_file=None,
                          check=False)
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert said == [f"error: cannot resume from {step_2}: its position.json says step 3, but its scheduler has stepped "
                    "2 times and its optimizer has taken 2 steps: the position was edited, or its files come from "
                    "different checkpoints; resume from another checkpoint"], result.stderr[-3000:]
    assert "warning: nothing proves that this user's runs wrote" in result.stderr
    assert not (tmp_path / "out" / "log.jsonl").exists()


@pytest.mark.slow
def test_a_resume_from_another_folder_finds_the_data_its_run_named_by_a_relative_path(tmp_path, reviews_csv, cache_dir):
    """`--data d.csv` from the folder the run started in, then `--resume <dir>/step_2` from another folder: the
    checkpoint records where its run started, and the resume reads the same d.csv, bit for bit."""
    import subprocess
    import sys

    from conftest import OFFLINE

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    shutil.copy(reviews_csv, project / "d.csv")
    run = [sys.executable, str(REPO / "train.py"), *map(str, TINY), "--cache_dir", str(cache_dir), "--max_steps", "4",
           "--save_steps", "2", "--eval_strategy", "no"]

    def train(cwd, *args):
        result = subprocess.run([*run, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600,
                                env={**os.environ, **OFFLINE})
        assert result.returncode == 0, result.stderr[-3000:]

    train(project, "--data", "d.csv", "--output_dir", "out")
    assert json.loads((project / "out" / "step_2" / POSITION).read_text())["started_in"] == str(project)
    train(elsewhere, "--resume", project / "out" / "step_2", "--output_dir", elsewhere / "resumed")
    assert losses(elsewhere / "resumed") == {step: loss for step, loss in losses(project / "out").items() if step > 2}
