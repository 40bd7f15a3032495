"""The exported model folder (textclf/models/folder.py): written, verified, read back; its logits batch-independent, its
files' modes, links at its folders."""

import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_batched_as_alone, to_train, untouched
from families import FAMILIES
from textclf.models.build import make_model, training_config
from textclf.models.tokenizer import get_tokenizer


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


@pytest.mark.parametrize("family", FAMILIES)
def test_each_text_gets_the_logits_it_gets_alone_in_a_padded_batch(family, family_model):
    """The decoders' tokenizers ship no pad token: it becomes their eos token, on the tokenizer and in the
    model's config, and padding goes right, so the head reads each text's own last token at the position
    it has alone (the left padding that Llama's tokenizer class defaults to shifts GPT-2's positions)."""
    from transformers import AutoTokenizer

    folder = family_model(family)
    assert (AutoTokenizer.from_pretrained(folder).pad_token is None) == (family != "bert")  # as shipped
    tokenizer = get_tokenizer(str(folder), None, "unused", "unused", 32)
    torch.manual_seed(0)
    model = to_train(str(folder), tokenizer, ["a", "b", "c"]).eval()
    if family != "bert":
        assert tokenizer.pad_token == tokenizer.eos_token
    assert tokenizer.padding_side == "right"
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    rng = random.Random(0)
    texts = ["好" * rng.randint(1, 25) + "吃" * rng.randint(0, 5) + " ok" * rng.randint(0, 2) for _ in range(21)]
    assert_batched_as_alone(model, tokenizer, texts)


def test_a_pickle_only_model_folder_is_one_line_and_runs_nothing(tmp_path, tiny_model):
    import pickle

    from conftest import refusal
    from textclf.predict import main

    class RunsCode:
        def __reduce__(self):
            return (open, (str(tmp_path / "code-ran"), "w"))

    folder = shutil.copytree(tiny_model, tmp_path / "model")
    (folder / "model.safetensors").unlink()
    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump(RunsCode(), f)
    error = refusal(main, ["--model", folder, "--text", "好", "--output", tmp_path / "p.jsonl"])
    assert "its weights are a pickle that holds more than tensors" in error
    assert not (tmp_path / "code-ran").exists() and not (tmp_path / "p.jsonl").exists()


@pytest.mark.parametrize("verbose", [False, True])
def test_an_export_shows_no_bars_of_transformers_unless_verbose(pretrained_backbone, tmp_path, capfd, monkeypatch,
                                                                verbose):
    """train.py and the export command say "exported" in one line; transformers would add a bar for writing the
    weights and one for reading them back. Both export inside the run's scope (textclf/launch/process.py)."""
    from transformers.utils import logging as transformers_logging

    from textclf.launch.process import run_scope
    from textclf.models.folder import save_verified

    if verbose:
        monkeypatch.setenv("TEXTCLF_VERBOSE", "1")
    transformers_logging.enable_progress_bar()  # as in a fresh process
    model, tokenizer = pretrained_backbone
    built = make_model(training_config(model, tokenizer, {"num_labels": 2}, 32), model)
    capfd.readouterr()
    with run_scope():
        save_verified(built.eval(), tokenizer, str(tmp_path / "exported"))
    out, err = capfd.readouterr()
    assert ("Writing model shards" in out + err and "Loading weights" in out + err) == verbose, out + err
    assert (tmp_path / "exported" / "model.safetensors").is_file()


def test_the_exported_model_replaces_links_at_its_folder_and_its_temporary_folder(tmp_path, victim, tiny_model):
    from textclf.models.folder import load_model_folder, save_verified

    target = tmp_path / "out" / "model"
    plant(target, victim / "folder")
    plant(tmp_path / "out" / ".model.incomplete", victim / "folder")
    model, tokenizer = load_model_folder(str(tiny_model))
    save_verified(model, tokenizer, str(target), overwrite=True)
    assert not target.is_symlink() and (target / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path / "out")) == ["model"] and untouched(victim)


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
