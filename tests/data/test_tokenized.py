"""Tokenizing (textclf/data/tokenized.py): cached, the cache trusted only as written, by one process per core where that
pays, the other ranks' waiting line."""

import json
import re
import time
from pathlib import Path

import datasets
import pytest

from conftest import (
    TINY,
    read_csv,
    train_forked,
    write_csv,
)
from textclf.cli import parse_config
from textclf.data.examples import load_splits
from textclf.data.reading import CHECKSUM_SUFFIX
from textclf.data.tokenized import tokenize, tokenizing_processes, waiting
from textclf.models.job import build_job
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


def run_data(data, cache_dir, *flags):
    """The data stages of a training run: (the tokenized train set, the tokenizer's folder)."""
    cfg = parse_config([*TINY, "--data", str(data), "--cache_dir", str(cache_dir), "--output_dir", "unused", *flags])
    job = build_job(cfg)
    return job.train_set, job.tokenizer.name_or_path


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


def test_tokenizing_uses_a_process_per_core_only_where_each_has_enough_rows(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert tokenizing_processes(1000) is None
    assert tokenizing_processes(1_000_000) == 2


def test_a_waiting_process_says_what_it_waits_for_and_again_at_intervals(monkeypatch, capsys):
    monkeypatch.setenv("TEXTCLF_WAIT_NOTE_S", "0.1")
    with waiting("process 1", "the local main process to tokenize 10 examples"):
        time.sleep(0.55)  # blocked, as in a barrier
    first, *notes = capsys.readouterr().out.splitlines()
    assert first == ("process 1: waiting for the local main process to tokenize 10 examples; then reading both from "
                     "its caches")
    assert 2 <= len(notes) <= 5
    assert all(re.fullmatch(r"process 1: still waiting for the local main process to tokenize 10 examples "
                            r"\(\d+ s so far\)", note) for note in notes)
    time.sleep(0.3)
    assert capsys.readouterr().out == ""  # the notes end with the wait


def test_a_second_run_is_a_cache_hit_and_a_changed_file_never_stale(tmp_path, reviews_csv, monkeypatch, capsys):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    data = write_csv(tmp_path / "reviews.csv", read_csv(reviews_csv))
    cache = tmp_path / "cache"

    first, folder = run_data(data, cache, "--tokenizer_sample", "100")
    printed = capsys.readouterr().out
    for stage in ("data: read", "data: labels and split", "data: learnt a tokenizer", "data: tokenized"):
        assert stage in printed

    again, same_folder = run_data(data, cache, "--tokenizer_sample", "100")
    printed = capsys.readouterr().out
    assert same_folder == folder and "tokens from the cache" in printed
    assert "tokenized before, from the cache" in printed
    assert again["input_ids"] == first["input_ids"]

    _, other_folder = run_data(data, cache, "--tokenizer_sample", "100", "--seed", "1")
    assert other_folder != folder  # another sample, another vocabulary

    rows = read_csv(data)
    rows[0]["review"] = "一句从没见过的新评论" + rows[0]["review"]
    write_csv(data, rows)  # same path, same size class: only the content tells
    _, changed_folder = run_data(data, cache, "--tokenizer_sample", "100")
    printed = capsys.readouterr().out
    assert changed_folder not in (folder, other_folder) and "data: learnt a tokenizer" in printed
    assert "tokenized before" not in printed


@pytest.mark.slow
def test_under_two_processes_rank_0_shows_the_data_stages_and_the_other_says_it_waits(tmp_path, reviews_csv):
    result = train_forked([*TINY, "--data", reviews_csv, "--cache_dir", tmp_path / "cache", "--max_steps", "1",
                           "--output_dir", tmp_path / "run"])
    for stage, lines in (("data: read", 1), ("data: labels and split", 1), ("data: learnt a tokenizer", 1),
                         ("data: tokenized", 2)):  # the training and the evaluation examples
        assert result.stdout.count(stage) == lines, stage
    assert result.stdout.count("process 1: waiting for the local main process") == 1
    # How often it says so again depends on how long rank 0 takes: test_a_waiting_process_says_what_it_waits_for...
    assert re.search(r"process 1: waiting for the local main process to prepare the tokenizer and tokenize "
                     r"\d+ \+ \d+ examples", result.stdout)


def test_only_the_ids_are_stored_and_the_collator_rebuilds_what_the_model_reads(tmp_path):
    from transformers import BertTokenizerFast, DataCollatorWithPadding

    from textclf.data.tokenized import tokenize
    from textclf.models.tokenizer import train_tokenizer

    texts = ["这个手机很好用", "质量太差了，不推荐", "good value", "物流很快", "一般般吧"] * 4
    train_tokenizer(texts, str(tmp_path / "tok"))
    tokenizer = BertTokenizerFast.from_pretrained(tmp_path / "tok")
    for columns in ({"text": texts}, {"text": texts, "text_pair": texts[::-1]}):
        table = datasets.Dataset.from_dict({**columns, "labels": [i % 2 for i in range(len(texts))]})
        tokenized = tokenize(table, tokenizer, max_length=8)
        pairs = "text_pair" in columns
        assert tokenized.column_names == ["labels", "input_ids", *(["token_type_ids"] if pairs else []), "length"]
        expected = tokenizer(columns["text"], columns.get("text_pair"), truncation=True, max_length=8, padding=True,
                             return_tensors="pt")
        batch = DataCollatorWithPadding(tokenizer)([row for row in tokenized.remove_columns(["length"])])
        assert batch["input_ids"].tolist() == expected["input_ids"].tolist()
        assert batch["attention_mask"].tolist() == expected["attention_mask"].tolist()
        assert tokenized["length"] == expected["attention_mask"].sum(1).tolist()
        if pairs:  # BERT marks the second text's tokens; a single text's types are all 0, the model's default
            assert batch["token_type_ids"].tolist() == expected["token_type_ids"].tolist()
            assert expected["token_type_ids"].any()
    # A model that takes no token types (DistilBERT, decoders) is given none, pairs or not.
    without_types = BertTokenizerFast.from_pretrained(tmp_path / "tok",
                                                      model_input_names=["input_ids", "attention_mask"])
    assert "token_type_ids" not in tokenize(table, without_types, max_length=8).column_names


def test_tokenization_is_cached_between_runs(tmp_path, reviews_csv):
    from transformers import BertTokenizerFast

    from textclf.data.examples import load_splits
    from textclf.data.tokenized import tokenize
    from textclf.models.tokenizer import train_tokenizer
    from textclf.tasks.task import Task

    train, _, _ = load_splits(str(reviews_csv), None, Task.of("single_label", "review", "label"), 0.1, 0)
    train_tokenizer(train["text"], str(tmp_path / "tok"))
    # Each run loads its own tokenizer object from the cached folder.
    first = tokenize(train, BertTokenizerFast.from_pretrained(tmp_path / "tok"), 32)
    again = tokenize(train, BertTokenizerFast.from_pretrained(tmp_path / "tok"), 32)
    assert first.cache_files and first.cache_files == again.cache_files
