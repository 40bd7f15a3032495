"""Writes that never follow a planted link (textclf/files.py)."""

import json
import os
from pathlib import Path

import pytest

from conftest import untouched


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def test_run_json_and_its_temporary_file_replace_links_never_write_through_them(tmp_path, victim):
    from textclf.files import write_json

    out = tmp_path / "out"
    plant(out / "run.json", victim / "file")
    plant(out / "run.json.tmp", victim / "folder" / "file")
    write_json(str(out / "run.json"), {"config": 1})
    assert not (out / "run.json").is_symlink() and json.loads((out / "run.json").read_text()) == {"config": 1}
    assert sorted(os.listdir(out)) == ["run.json"] and untouched(victim)


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
