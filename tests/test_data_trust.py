"""The caches `datasets` writes of the data (the table read, its columns chosen, the tokenized examples) are trusted
only as written (textclf/data/reading.py): a cache file whose bytes or size differ from the checksum recorded
beside it, or that has no record, is removed and made again from the data, in one line; a valid cache is read as it
is."""

import json
import re
from pathlib import Path

import datasets
import pytest

from conftest import TINY, read_csv, train_forked, write_csv
from textclf.data.examples import load_splits
from textclf.data.reading import CHECKSUM_SUFFIX
from textclf.data.tokenized import tokenize
from textclf.tasks.task import Task

REBUILT = "data: the cache of tokenized examples in "


@pytest.fixture
def examples(tmp_path, reviews_csv, monkeypatch):
    """(the training split of the reviews, read into a `datasets` cache of this test's own, a tokenizer for it)."""
    from transformers import BertTokenizerFast

    from textclf.models.tokenizer import train_tokenizer

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    train, _, _ = load_splits(str(reviews_csv), None, Task.of("single_label", "review", "label"), 0.1, 0)
    train_tokenizer(train["text"], str(tmp_path / "tok"))
    return train, BertTokenizerFast.from_pretrained(tmp_path / "tok")


def tokenized_files(table) -> list[Path]:
    files = [Path(file["filename"]) for file in table.cache_files]
    assert files and all(Path(f"{file}{CHECKSUM_SUFFIX}").exists() for file in files)
    return files


def flip_a_token_id(file: Path, ids: list[int]) -> None:
    """Change one token id of the example whose ids are `ids`, in place: the file still reads, one id differs."""
    data = bytearray(file.read_bytes())
    at = data.find(b"".join(i.to_bytes(4, "little") for i in ids))
    assert at >= 0
    data[at + 4] ^= 1  # the example's second id
    file.write_bytes(bytes(data))


def truncate(file: Path, ids: list[int]) -> None:
    file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])


def drop_the_record(file: Path, ids: list[int]) -> None:
    Path(f"{file}{CHECKSUM_SUFFIX}").unlink(missing_ok=True)


def test_a_valid_cache_is_read_as_it_is(examples, capsys):
    train, tokenizer = examples
    first = tokenize(train, tokenizer, 32, show_progress=True)
    [file] = tokenized_files(first)
    written = file.stat().st_mtime_ns
    again = tokenize(train, tokenizer, 32, show_progress=True)
    printed = capsys.readouterr().out
    assert REBUILT not in printed and "tokenized before, from the cache" in printed
    assert again.cache_files == first.cache_files and file.stat().st_mtime_ns == written
    assert json.loads(Path(f"{file}{CHECKSUM_SUFFIX}").read_text())["size"] == file.stat().st_size


def test_the_same_tokenizer_loaded_from_another_folder_reads_the_same_cache(examples, tmp_path, capsys):
    """A resume loads the tokenizer it trained with from its checkpoint, not from the folder the first run learnt it
    in: the cache is named by what the tokenizer does, so the resume reads the run's tokenized examples."""
    import shutil

    from transformers import BertTokenizerFast

    train, tokenizer = examples
    first = tokenize(train, tokenizer, 32)
    shutil.copytree(tmp_path / "tok", tmp_path / "step_5" / "tokenizer")
    saved = BertTokenizerFast.from_pretrained(tmp_path / "step_5" / "tokenizer")
    again = tokenize(train, saved, 32, show_progress=True)
    assert again.cache_files == first.cache_files and "tokenized before, from the cache" in capsys.readouterr().out


@pytest.mark.parametrize("damage, said", [
    (flip_a_token_id, r"is damaged \(cache-\w+\.arrow: its sha256 is not the one recorded when it was written\)"),
    (truncate, r"is damaged \(cache-\w+\.arrow: [\d,]+ bytes where [\d,]+ were written\)"),
    (drop_the_record, r"is unverified \(cache-\w+\.arrow: no checksum was recorded beside it when it was written\)"),
], ids=["a token id flipped", "truncated", "no record"])
def test_a_damaged_cache_is_tokenized_again_in_one_line(examples, capsys, damage, said):
    train, tokenizer = examples
    first = tokenize(train, tokenizer, 32)
    expected = first["input_ids"][:]  # read now: the table maps the file that is damaged next
    [file] = [Path(cached["filename"]) for cached in first.cache_files]
    damage(file, expected[0])
    del first
    again = tokenize(train, tokenizer, 32, show_progress=True)
    assert again["input_ids"][:] == expected
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(REBUILT)]
    assert len(lines) == 1 and re.fullmatch(re.escape(f"{REBUILT}{file.parent} ") + said + "; tokenizing again",
                                            lines[0]), lines
    assert tokenized_files(again) == [file]  # rebuilt where it was, its checksum recorded again
    tokenize(train, tokenizer, 32, show_progress=True)
    assert REBUILT not in capsys.readouterr().out


def test_of_the_files_several_processes_wrote_only_the_damaged_one_is_tokenized_again(examples, capsys):
    train, tokenizer = examples
    first = tokenize(train, tokenizer, 32, num_proc=2)
    expected = first["input_ids"][:]
    files = [Path(cached["filename"]) for cached in first.cache_files]
    assert len(files) == 2
    kept = files[1].stat().st_mtime_ns
    flip_a_token_id(files[0], expected[0])
    del first
    again = tokenize(train, tokenizer, 32, num_proc=2)
    assert again["input_ids"][:] == expected
    assert capsys.readouterr().out.count(REBUILT) == 1 and tokenized_files(again) == files
    assert files[1].stat().st_mtime_ns == kept


@pytest.mark.slow
def test_under_two_processes_only_the_local_main_process_tokenizes_a_damaged_cache_again(tmp_path, reviews_csv):
    """Rank 0 checks the cache and tokenizes again what is damaged, before rank 1 reads it: the line is said once
    per split, and the files are as first written."""
    data = write_csv(tmp_path / "reviews.csv", read_csv(reviews_csv))  # a `datasets` cache folder of its own
    args = [*TINY, "--data", data, "--cache_dir", tmp_path / "cache", "--max_steps", "1"]
    first = train_forked([*args, "--output_dir", tmp_path / "first"])
    folder = Path(re.search(r"data: tokenized \d+ examples in [\d.]+ s, cached in (\S+)", first.stdout)[1])
    recorded = sorted(Path(str(record).removesuffix(CHECKSUM_SUFFIX)) for record in folder.glob(f"*{CHECKSUM_SUFFIX}"))
    # Beside them, the caches of the table read and its columns chosen (recorded too): the tokenized hold token ids.
    files = [file for file in recorded if "input_ids" in datasets.Dataset.from_file(str(file)).column_names]
    assert len(files) == 2  # the training and the evaluation examples
    written = {file: file.read_bytes() for file in files}
    for file, data in written.items():
        file.write_bytes(data[:len(data) // 2])
    again = train_forked([*args, "--output_dir", tmp_path / "again"])
    assert again.stdout.count(REBUILT) == 2, again.stdout
    assert {file: file.read_bytes() for file in files} == written


@pytest.mark.parametrize("cached", ["the table read from", "the texts and labels of"])
def test_a_changed_character_in_the_prepared_table_s_cache_is_read_again_never_trained_on(
        cached, tmp_path, reviews_csv, monkeypatch, capsys):
    """What `datasets` caches of a data file before tokenizing (the table it read, then its columns chosen): one
    character changed in a cache file (好 to 坏, as many bytes) used to be read as the data, a new fingerprint and a new
    tokenizer and nothing said. Checked like the tokenized cache: it is read again from the file, in one line."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    task = Task.of("single_label", "review", "label")
    first, _, _ = load_splits(str(reviews_csv), None, task, 0.1, 0)
    first = (list(first["text"]), list(first["labels"]))  # read now: the table maps the files changed below
    built = sorted(path for path in (tmp_path / "datasets").rglob("*.arrow")
                   if Path(f"{path}{CHECKSUM_SUFFIX}").exists())
    file = next(path for path in built if (path.name.startswith("csv-") == (cached == "the table read from")))
    data = file.read_bytes()
    assert "好".encode() in data
    file.write_bytes(data.replace("好".encode(), "坏".encode(), 1))
    capsys.readouterr()
    again, _, _ = load_splits(str(reviews_csv), None, task, 0.1, 0)
    said = [line for line in capsys.readouterr().out.splitlines() if "damaged" in line]
    assert said == [f"data: the cache of {cached} {reviews_csv} in {file.parent} is damaged ({file.name}: its sha256 "
                    "is not the one recorded when it was written); reading it again"]
    assert (list(again["text"]), list(again["labels"])) == first
    assert file.read_bytes() == data  # made again as it was first written
