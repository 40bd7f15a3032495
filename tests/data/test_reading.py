"""Reading the user's files (textclf/data/reading.py): every format and encoding, why a file cannot be read in one line,
empty texts dropped, a text column of numbers, the caches datasets writes of the data trusted only as written."""

import csv
import io
import json
import os
from pathlib import Path

import datasets
import pytest

from conftest import (
    read_csv,
)
from textclf.config import TrainConfig
from textclf.data.examples import load_splits, read_labelled
from textclf.data.reading import CHECKSUM_SUFFIX, load_table
from textclf.errors import InputError
from textclf.predict import read_inputs
from textclf.tasks.task import Task


@pytest.fixture(scope="module")
def rows(reviews_csv):
    return [{"label": row["label"], "review": row["review"]} for row in read_csv(reviews_csv)][:40]


def delimited(rows, delimiter):
    text = io.StringIO()
    writer = csv.writer(text, delimiter=delimiter, lineterminator="\n")
    writer.writerows([["label", "review"]] + [list(row.values()) for row in rows])
    return text.getvalue()


def json_lines(rows):
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


FORMATS = {
    "csv": ("data.csv", lambda rows: delimited(rows, ","), {}),
    "tsv": ("data.tsv", lambda rows: delimited(rows, "\t"), {}),
    "pipes, any suffix": ("data.txt", lambda rows: delimited(rows, "|"), {"delimiter": "|"}),
    "json lines": ("data.jsonl", json_lines, {}),
    "json": ("data.json", lambda rows: json.dumps(rows, ensure_ascii=False), {}),
}


def write(path, content: bytes):
    path.write_bytes(content)
    return str(path)


UNREADABLE = {
    "binary junk": ("junk.csv", bytes(range(256)) * 8, {},
                    "cannot read {path}: it is not text (it holds NUL bytes;"),
    "utf-16": ("wide.csv", "label,review\npositive,好\n".encode("utf-16"), {},
               "cannot read {path}: it is UTF-16 text; pass --encoding utf-16"),
    "neither utf-8 nor gb18030": ("latin.csv", b"label,review\npositive,caf\xe9\xff\n", {},
                                  "cannot read {path}: it is not UTF-8 (undecodable byte 0xe9 at line 2, column 13) "
                                  "nor GB18030"),
    "not the encoding given": ("given.csv", "label,review\npositive,好吃\n".encode("gbk"), {"encoding": "utf-8"},
                               "cannot read {path} as utf-8: undecodable byte 0xba at line 2, column 10; pass the "
                               "file's encoding with --encoding"),
    "too many fields": ("fields.csv", b"label,review\npositive,good\nnegative,bad, really bad\n", {},
                        "cannot parse {path} as delimited text (delimiter ','): line 3 has 3 fields where the lines "
                        "before have 2; quote fields that contain the delimiter"),
    "tab-separated text read as csv": ("tabs.csv",
                                       "label\treview\npositive\t好，很好\nnegative\t差,很差\n".encode(), {},
                                       "line 3 has 2 fields where the lines before have 1; quote fields that contain "
                                       "the delimiter (\"a,b\"), or pass the file's delimiter with --delimiter "
                                       "(e.g. --delimiter '\\t')"),
    "bad json line": ("bad.jsonl", b'{"label": "positive", "review": "ok"}\n{"label": positive}\n', {},
                      "cannot parse {path} as JSON: line 2, column 11: Expecting value; expected one JSON object "
                      "per line (JSON Lines)"),
    "bad json": ("bad.json", b'[{"label": "positive", "review": "ok"},\n {"label": "negative" "review": "no"}]', {},
                 "cannot parse {path} as JSON: line 2, column 23: Expecting ',' delimiter"),
    "json of the wrong shape": ("shape.json", b'{"rows": 3}\n[1, 2]', {}, "cannot parse {path} as JSON: line 2"),
    "unknown suffix": ("data.txt", b"label,review\n", {}, "cannot read {path}: unknown file type '.txt'"),
    "not parquet": ("data.parquet", b"label,review\n", {}, "cannot read {path} as parquet: "),
    "empty": ("empty.jsonl", b"", {},
              "data set {path} is empty: no rows; give at least one row (in delimited text, a header and a row)"),
}


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("case", FORMATS)
@pytest.mark.parametrize("encoding", ["utf-8", "gbk", "gb18030"])
def test_every_format_reads_the_same_rows_in_utf8_and_in_chinese_encodings(tmp_path, capsys, rows, case, encoding):
    name, render, options = FORMATS[case]
    path = tmp_path / name
    content = render(rows).encode(encoding)
    path.write_bytes(content)
    table = load_table(str(path), **options)
    assert table.column_names == ["label", "review"] and table[:] == {k: [r[k] for r in rows] for k in rows[0]}
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    if encoding == "utf-8":
        assert not notes
    else:  # said once, with where UTF-8 failed
        with pytest.raises(UnicodeDecodeError) as where:
            content.decode("utf-8")
        at = where.value.start
        line, column = content.count(b"\n", 0, at) + 1, at - (content.rfind(b"\n", 0, at) + 1) + 1
        assert notes == [f"note: {path} is not UTF-8 (undecodable byte 0x{content[at]:02x} at line {line}, "
                         f"column {column}); reading it as GB18030 (GBK). Choose another encoding with --encoding"]
    assert sorted(os.listdir(tmp_path)) == [name]  # no converted copy beside the user's data


def test_parquet_and_a_datasets_folder(tmp_path, rows):
    from datasets import Dataset

    Dataset.from_list(rows).to_parquet(str(tmp_path / "data.parquet"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for path in ("data.parquet", "saved"):
        assert load_table(str(tmp_path / path))["review"] == [row["review"] for row in rows]


def test_an_encoding_given_is_used_and_not_guessed(tmp_path, capsys, rows):
    path = tmp_path / "big5.csv"
    path.write_bytes(delimited(rows[:3], ",").encode("big5", errors="replace"))
    assert load_table(str(path), encoding="big5")["label"] == [row["label"] for row in rows[:3]]
    assert "note:" not in capsys.readouterr().out


@pytest.mark.parametrize("case", UNREADABLE)
def test_a_file_that_cannot_be_read_is_one_line_naming_the_cause_and_what_to_do(tmp_path, case):
    name, content, options, message = UNREADABLE[case]
    path = write(tmp_path / name, content)
    with pytest.raises(InputError) as error:
        load_table(path, **options)
    assert message.format(path=path) in str(error.value)
    assert "\n" not in str(error.value)


def test_a_tsv_named_csv_that_parses_as_one_column_points_at_the_delimiter(tmp_path):
    from textclf.data.examples import load_splits
    from textclf.tasks.task import Task

    path = write(tmp_path / "tabs.csv", "label\treview\npositive\t好\nnegative\t差\n".encode())
    with pytest.raises(InputError, match="its columns are: label\treview .choose with --text_column or pass the "
                                         "file's delimiter with --delimiter"):
        load_splits(path, None, Task.of("single_label", "review", "label"), 0.1, 0)


@pytest.mark.parametrize("encoding", ["utf-8", "gb18030"])
def test_where_decoding_fails_is_found_across_chunks(tmp_path, rows, encoding):
    from textclf.data.reading import undecodable

    good = json_lines(rows).encode(encoding)
    at = good.index("，".encode(encoding), 300)  # a character boundary: before a full-width comma
    path = write(tmp_path / "data.jsonl", good[:at] + b"\xff\xff" + good[at:])
    line, column = good.count(b"\n", 0, at) + 1, at - (good.rfind(b"\n", 0, at) + 1) + 1
    for chunk_size in (7, 64, 1 << 24):  # a multi-byte character cut by every chunk boundary, or none
        assert undecodable(path, encoding, chunk_size) == f"byte 0xff at line {line}, column {column}"
        assert undecodable(write(tmp_path / "good.jsonl", good), encoding, chunk_size) is None


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


@pytest.mark.parametrize("suffix, rows", [
    (".csv", "label,review\npos,23\nneg,45\n"),
    (".jsonl", '{"review": 12, "label": "pos"}\n{"review": "x", "label": "neg"}\n'),
], ids=["numbers", "mixed"])
def test_a_text_column_of_numbers_is_refused(tmp_path, suffix, rows):
    path = tmp_path / f"data{suffix}"
    path.write_text(rows)
    task = Task.from_config(TrainConfig())
    for read in (read_labelled, read_inputs):  # training and report, predict
        with pytest.raises(InputError, match="the text column 'review' holds .* values, not text; choose"):
            read(str(path), task)


def test_empty_texts_are_dropped_with_one_warning_that_counts_them(tmp_path, capsys):
    from textclf.data.examples import load_splits
    from textclf.tasks.task import Task

    rows = "label,review\n" + "".join(f"{i % 2},\ufeff评论{i}\n" for i in range(40)) + "1,\n0,   \n"
    task = Task.of("single_label", text_column="review", label_column="label")
    train, held_out, names = load_splits(str(_write(tmp_path / "d.csv", rows)), None, task, 0.1, 0)
    assert len(train) + len(held_out) == 40 and names == ["0", "1"]
    assert not any(text.startswith("\ufeff") for text in train["text"])
    assert capsys.readouterr().out.count("warning: dropped 2 row(s) with empty text") == 1
