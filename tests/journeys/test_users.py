"""A newcomer's journeys that cross modules: the data stage said by rank 0 alone, and the suite beside a finished run in
the repository's checkpoints/."""

import re

import pytest

from conftest import splits
from textclf.errors import InputError


def test_lines_about_the_data_come_from_rank_0_alone(tmp_path, capsys, monkeypatch):
    rows = "label,review\n" + "".join(f"{i % 2},评论{i}\n" for i in range(20)) + "1,\n"
    monkeypatch.setenv("RANK", "1")
    splits(tmp_path, "d.csv", rows)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    splits(tmp_path, "d.csv", rows)
    lines = [re.sub(r"in \d+\.\d s$", "in <time>", line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [f"warning: dropped 1 row(s) with empty text from {tmp_path / 'd.csv'}",
                     f"data: read {tmp_path / 'd.csv'}: 20 rows in <time>",
                     f"eval: 25% (5 examples) of {tmp_path / 'd.csv'} held out, stratified by label",
                     "data: labels and split: 15 train / 5 eval examples in <time>"]


def test_the_suite_runs_beside_a_finished_run_in_the_repository_checkpoints(monkeypatch):
    """The quickstart leaves checkpoints/ holding a finished run, then the user runs the tests: every test runs
    beside one (conftest puts one there for the session if there is none), so a test that falls back on the default
    output folder fails here too, and the session fails if a test changed checkpoints/, data/ or wandb/."""
    from conftest import REPO
    from textclf.checkpointing.folders import find_checkpoint
    from textclf.config import TrainConfig

    monkeypatch.chdir(REPO)
    with pytest.raises(InputError, match="checkpoints already holds checkpoints"):
        find_checkpoint(TrainConfig())
