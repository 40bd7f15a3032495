"""The run's tokenizer (textclf/models/tokenizer.py): the sample it is learnt from, its cache trusted only as learnt, a
resume's own taken whatever the cache holds."""

import json
import os
import shutil

import datasets
import pytest

from conftest import TINY, assert_refused, assert_same_run, train_forked
from textclf.errors import InputError
from textclf.models.tokenizer import sample_key, text_sample

LEARNT = "data: learnt a tokenizer"


def says_checkpoint_tokenizer(output: str, checkpoint) -> bool:
    """Whether the run said it took the tokenizer `checkpoint` saved."""
    return any(line.startswith("data: the tokenizer of ") and
               line.endswith(f"tokens that the checkpoint was trained with, from {checkpoint / 'tokenizer'}")
               for line in output.splitlines())


@pytest.fixture
def step_2(tmp_path, four_step_run):
    return shutil.copytree(four_step_run / "step_2", tmp_path / "step_2")


def texts_of(batches) -> list[str]:
    return [text for batch in batches for text in batch]


@pytest.mark.parametrize("damage", ["truncated tokenizer.json", "truncated vocab.txt", "missing vocab.txt",
                                    "missing learnt_files.json", "planted added_tokens.json"])
def test_a_damaged_tokenizer_cache_is_one_line_and_learnt_again_once_deleted(tmp_path, damage):
    """A learnt tokenizer is cached with the sha256 of its files: a damaged one is refused, naming the folder, not
    loaded as another vocabulary (a truncated vocab.txt loads without a word) or failed on in the tokenizers
    library. The record is required (without it, ids swapped would load without a word), and a file it does not
    name, which loading would read all the same, is refused too."""
    import shutil

    from textclf.models.tokenizer import get_tokenizer

    texts = ["这家店的菜很好吃", "太难吃了，再也不会买了", "送餐很快", "质量很差"] * 20
    learnt = get_tokenizer("scratch-tiny", texts, str(tmp_path), "key", 32)
    folder = tmp_path / next(name for name in os.listdir(tmp_path) if name.startswith("tokenizer-key-"))
    name = damage.split()[-1]
    if damage.startswith("missing"):
        (folder / name).unlink()
    elif damage.startswith("planted"):
        (folder / name).write_text('{"[NEW]": 0}', encoding="utf-8")
    else:
        (folder / name).write_bytes((folder / name).read_bytes()[:100])
    with pytest.raises(InputError) as refused:
        get_tokenizer("scratch-tiny", texts, str(tmp_path), "key", 32)
    line = str(refused.value)
    assert line.startswith(f"the tokenizer cached in {folder} is damaged (") and len(line.splitlines()) == 1
    assert name in line and line.endswith("delete that folder, and the next run learns one again from the data")
    shutil.rmtree(folder)
    assert len(get_tokenizer("scratch-tiny", texts, str(tmp_path), "key", 32)) == len(learnt)


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


def test_the_tokenizer_sample_is_bounded_seeded_and_the_same_twice():
    table = datasets.Dataset.from_dict({"text": [f"text {i}" for i in range(1000)]})
    sample = texts_of(text_sample(table, 100, seed=7))
    assert len(sample) == 100 == len(set(sample))
    assert sample == texts_of(text_sample(table, 100, seed=7))
    assert sample != texts_of(text_sample(table, 100, seed=8))
    assert texts_of(text_sample(table, 0, seed=7)) == table["text"]  # 0: every text
    assert texts_of(text_sample(table, 5000, seed=7)) == table["text"]  # more than there are: every text


def test_the_sample_of_pairs_holds_both_texts_of_each_example_drawn():
    table = datasets.Dataset.from_dict({"text": [f"a{i}" for i in range(50)],
                                        "text_pair": [f"b{i}" for i in range(50)]})
    sample = texts_of(text_sample(table, 10, seed=0))
    firsts = {text[1:] for text in sample if text.startswith("a")}
    assert len(sample) == 20 and firsts == {text[1:] for text in sample if text.startswith("b")}


def test_the_cache_key_names_the_sample():
    assert sample_key("f", 1000, 100, 7) != sample_key("f", 1000, 100, 8) != sample_key("f", 1000, 200, 8)
    assert sample_key("f", 1000, 0, 7) == sample_key("f", 1000, 5000, 8)  # every example either way
    assert sample_key("f", 1000, 0, 7) != sample_key("g", 1000, 0, 7)
