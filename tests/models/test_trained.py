"""A trained model read back (textclf/models/trained.py): a damaged weights file is one line."""

import shutil

import pytest

from conftest import one_line
from textclf.errors import InputError
from textclf.models.trained import load_trained


@pytest.fixture
def step_2(tmp_path, four_step_run):
    return shutil.copytree(four_step_run / "step_2", tmp_path / "step_2")


def test_a_truncated_weights_file_is_one_line_not_a_safetensors_traceback(step_2):
    weights = step_2 / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(InputError) as refused:
        load_trained(str(step_2))
    assert "model.safetensors has 1000 bytes, " in one_line(refused)
