"""What a model folder's weights are trusted with: only a new classification head is trained from random weights;
a weight of the model's body saved in another shape than its config says is refused in one line, by train.py as by
predict and export (docs/faults.md)."""

import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertForSequenceClassification

from conftest import TINY, assert_refused, run_train
from textclf.errors import InputError
from textclf.models.build import make_model, training_config

EMBEDDINGS = "bert.embeddings.word_embeddings.weight"


def halve(folder, key: str = EMBEDDINGS) -> None:
    """The folder's saved `key` cut to half its rows, its config left as it was."""
    weights = load_file(folder / "model.safetensors")
    weights[key] = weights[key][: weights[key].shape[0] // 2].clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def folder(tmp_path):
    """A BertForSequenceClassification folder of 2 labels whose config says vocab_size 64."""
    folder = tmp_path / "model"
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, num_labels=2)).save_pretrained(folder)
    return folder


def to_fine_tune(folder, num_labels: int = 2):
    """The model train.py builds from `folder` (make_model of its config with the task's head)."""
    return make_model(training_config(str(folder), SimpleNamespace(pad_token_id=0), {"num_labels": num_labels}, 32),
                      str(folder))


@pytest.mark.parametrize("num_labels", [2, 3], ids=["same head", "new head"])
def test_body_weights_of_the_wrong_shape_are_refused_in_one_line_naming_them(folder, num_labels, capsys):
    halve(folder)
    with pytest.raises(InputError) as refused:
        to_fine_tune(folder, num_labels)
    assert str(refused.value) == (
        f"cannot fine-tune {folder}: its saved {EMBEDDINGS} is [32, 16] where its config makes it [64, 16]; only a "
        "new classification head is trained from random weights, never the model's body: save the config and the "
        "weights from one model (save_pretrained), or choose another --model")
    assert "trained from random weights" not in "".join(capsys.readouterr())


def test_several_misshapen_body_weights_are_counted(folder):
    halve(folder)
    halve(folder, "bert.embeddings.position_embeddings.weight")
    with pytest.raises(InputError, match=r"position_embeddings.weight is \[256, 16\] where its config makes it "
                                         r"\[512, 16\] \(and 1 more: bert.embeddings.word_embeddings.weight\); "):
        to_fine_tune(folder)


def test_a_head_of_another_shape_is_still_new_and_said_so(folder, capsys):
    model = to_fine_tune(folder, num_labels=3)
    assert model.classifier.weight.shape == (3, 16)
    assert f"note: {folder}: new classifier, trained from random weights (the classification head)" in \
        "".join(capsys.readouterr())


def test_predict_and_export_refuse_them_as_before(folder):
    from transformers import AutoConfig

    halve(folder)
    with pytest.raises(InputError) as refused:
        make_model(AutoConfig.from_pretrained(folder), str(folder), complete=True)
    assert str(refused.value) == f"{folder}: weights missing or of the wrong shape for its config: " \
                                 f"('{EMBEDDINGS}', torch.Size([32, 16]), torch.Size([64, 16]))"


@pytest.mark.slow
def test_train_py_refuses_a_model_folder_whose_body_does_not_fit_and_writes_nothing(tmp_path, tiny_model, reviews_csv,
                                                                                   cache_dir):
    folder = shutil.copytree(tiny_model, tmp_path / "model")
    halve(folder)
    out = tmp_path / "out"
    result = run_train([*TINY, "--model", folder, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", 1,
                        "--output_dir", out], check=False)
    assert_refused(result, f"cannot fine-tune {folder}: its saved {EMBEDDINGS} is ")
    assert not os.path.exists(out)
