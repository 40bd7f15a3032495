"""Checkpoints as a run writes them (textclf/checkpointing/write.py): every file recorded, the secret made at first use
and the seal, links planted at the folders, a save that runs out of memory."""

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from conftest import untouched
from textclf.checkpointing.folders import POSITION, checkpoint_folder
from textclf.checkpointing.verify import (
    read_verified_position,
)
from textclf.checkpointing.write import (
    SECRET_FILE,
    own_secret,
    read_secret,
    sealed,
    sealed_checkpoint,
    secret_file_problem,
    secret_path,
)
from textclf.errors import InputError


@pytest.fixture
def step_2(tmp_path, four_step_run):
    return shutil.copytree(four_step_run / "step_2", tmp_path / "step_2")


def save_checkpoint(accelerator, output_dir: str, position: dict) -> str:
    """A checkpoint saved as train.py saves one: accelerate's save_state into the folder sealed_checkpoint yields."""
    with sealed_checkpoint(accelerator, output_dir, position) as folder:
        accelerator.save_state(folder)
    return checkpoint_folder(output_dir, position["step"])


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def test_every_file_is_recorded_with_its_sha256_and_position_json_with_its_own(step_2):
    position = json.loads((step_2 / POSITION).read_text())
    on_disk = sorted(str(path.relative_to(step_2)) for path in step_2.rglob("*") if path.is_file())
    assert sorted(position["files"]) == sorted(set(on_disk) - {POSITION})
    assert all(len(entry["sha256"]) == 64 for entry in position["files"].values())
    assert sealed(position, own_secret()) == position  # signed with this user's secret, then sealed


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
    (tmp_path / "short").chmod(0o600)
    monkeypatch.setenv(SECRET_FILE, str(tmp_path / "short"))
    with pytest.raises(InputError, match=f"holds 5 bytes, fewer than 32: delete it .* {SECRET_FILE}"):
        own_secret()


def test_a_secret_that_is_not_this_user_s_alone_is_refused_and_nothing_is_signed_with_it(tmp_path, monkeypatch):
    """A file someone else could have planted or read (a link, dangling or not; a folder; another user's; open to
    others) signs nothing: one line, and no checkpoint is written unsigned in its place."""
    planted = tmp_path / "planted"
    planted.write_bytes(os.urandom(32))
    planted.chmod(0o600)
    refused = {
        "a link": (plant(tmp_path / "link", planted), "it is a symbolic link"),
        "a dangling link": (plant(tmp_path / "dangling", tmp_path / "nowhere"), "it is a symbolic link"),
        "a folder": (tmp_path / "a_folder", "is not a regular file"),
    }
    (tmp_path / "a_folder").mkdir()
    os.mkfifo(tmp_path / "a_fifo")  # opened as a file, it would wait for a writer forever
    refused["a FIFO"] = (tmp_path / "a_fifo", "is not a regular file")
    open_to_others = tmp_path / "open"
    open_to_others.write_bytes(os.urandom(32))
    open_to_others.chmod(0o644)
    refused["open to others"] = (open_to_others, "has mode 644, open to others")
    for what, (path, why) in refused.items():
        monkeypatch.setenv(SECRET_FILE, str(path))
        for call in (read_secret, own_secret):
            with pytest.raises(InputError, match=f"{why}.*{SECRET_FILE}"):
                call()
    assert not (tmp_path / "nowhere").exists()  # the dangling link was not followed to make a secret there
    monkeypatch.setenv(SECRET_FILE, str(planted))
    assert read_secret() == planted.read_bytes()
    other = os.getuid() + 1000  # (mode, inode, device, links, uid, gid, size, times): a file of another user's
    assert secret_file_problem(os.stat_result((0o100600, 1, 1, 1, other, 0, 32, 0, 0, 0))) == (
        f"belongs to another user (uid {other})")
    assert secret_file_problem(os.stat_result((0o100600, 1, 1, 1, 0, 0, 32, 0, 0, 0))) is None  # root's, as ssh


def test_a_file_system_that_does_not_keep_the_secret_private_is_named_as_such(tmp_path, monkeypatch):
    """A mount that shows every file with one owner and mode (CIFS, a Windows drive): the secret just made 0600 reads
    back open to others; the line says where to put it instead, not to delete it (a new one would fare the same)."""
    from textclf.checkpointing import write

    monkeypatch.setattr(write, "secret_file_problem", lambda stat: "has mode 755, open to others")
    monkeypatch.setenv(SECRET_FILE, str(tmp_path / "mounted" / "secret"))
    with pytest.raises(InputError, match=f"does not stay private on its file system .* set {SECRET_FILE} to a file "
                                         "on a local disk"):
        own_secret()


def test_links_in_place_of_a_step_folder_and_its_temporary_folder_are_replaced(tmp_path, victim):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState


    out = tmp_path / "out"
    plant(out / ".incomplete_step_2", victim / "folder")
    plant(out / "step_2", victim / "folder")
    accelerator = Accelerator(cpu=True)
    try:
        path = save_checkpoint(accelerator, str(out), {"step": 2})
    finally:
        AcceleratorState._reset_state(True)
    assert path == str(out / "step_2") and not (out / "step_2").is_symlink()
    assert read_verified_position(path)["step"] == 2 and sorted(os.listdir(out)) == ["step_2"]
    assert untouched(victim)


def test_out_of_memory_while_saving_a_checkpoint_is_named_as_such_and_leaves_nothing(tmp_path, monkeypatch):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState


    accelerator = Accelerator(cpu=True)

    def gather_runs_out(folder):  # as ZeRO-3's gather of the 16-bit weights does on a GPU that is full
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(accelerator, "save_state", gather_runs_out)
    try:
        with pytest.raises(InputError) as refused:
            save_checkpoint(accelerator, str(tmp_path), {"step": 2})
    finally:
        AcceleratorState._reset_state(True)
    assert str(refused.value).startswith(f"cannot save checkpoint {tmp_path / 'step_2'}: out of memory (CUDA out of "
                                         "memory); the disk is not the cause")
    assert os.listdir(tmp_path) == []
