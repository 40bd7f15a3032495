"""Data at scale, kept honest on small data: the tokenizer's sample (seeded, bounded, the same twice), the
caches (a second run is a hit, a changed file is never served stale), and the lines that show progress."""

import json
import os
import re
import subprocess
import sys
import time

import datasets
import pytest

from conftest import OFFLINE, REPO, TINY, read_csv, train_forked, write_csv
from textclf.cli import parse_config
from textclf.data.tokenized import tokenizing_processes, waiting
from textclf.errors import InputError
from textclf.models.job import build_job, load_data
from textclf.models.tokenizer import sample_key, text_sample


def texts_of(batches) -> list[str]:
    return [text for batch in batches for text in batch]


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


def run_data(data, cache_dir, *flags):
    """The data stages of a training run: (the tokenized train set, the tokenizer's folder)."""
    cfg = parse_config([*TINY, "--data", str(data), "--cache_dir", str(cache_dir), "--output_dir", "unused", *flags])
    job = build_job(cfg)
    return job.train_set, job.tokenizer.name_or_path


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


def test_the_sample_size_is_checked_and_recorded_in_the_config():
    with pytest.raises(InputError, match=r"tokenizer_sample must be 0 \(every example\) or more, got -1"):
        parse_config(["--tokenizer_sample", "-1"])
    assert parse_config([]).to_dict()["tokenizer_sample"] == 100_000


def test_load_data_reads_the_same_examples_as_before(tmp_path, reviews_csv):
    cfg = parse_config([*TINY, "--data", str(reviews_csv), "--output_dir", "unused"])
    train_set, eval_set, names, fingerprint = load_data(cfg)
    rows = read_csv(reviews_csv)
    assert len(train_set) + len(eval_set) == len(rows) and sorted(names) == ["negative", "positive"]
    assert set(train_set["text"]) | set(eval_set["text"]) == {row["review"].strip() for row in rows}


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


@pytest.mark.slow
def test_the_data_stage_benchmark_writes_its_table(tmp_path, reviews_csv):
    result = subprocess.run([sys.executable, "-m", "benchmarks.data_stage", "--data", str(reviews_csv), "--rows",
                             "300,600", "--output_dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                            timeout=1800, env={**os.environ, **OFFLINE})
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    rows = json.loads((tmp_path / "data_stage.json").read_text(encoding="utf-8"))
    assert [(row["rows"], row["run"]) for row in rows] == [(300, "first"), (300, "second"), (600, "first"),
                                                           (600, "second")]
    assert all(0 < row["first_step_s"] < row["wall_s"] and row["peak_rss_mb"] > 0 and row["cpu_s"] > 0 for row in rows)
    assert "| 600 | warm (second run) |" in (tmp_path / "data_stage.md").read_text(encoding="utf-8")
    second = (tmp_path / "rows_600" / "console_second.txt").read_text(encoding="utf-8")
    assert "tokenized before, from the cache" in second  # the second run is a cache hit


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
