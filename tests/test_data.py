"""Reading the user's files (textclf.data.load_table): the formats, encodings, and one clear line for every
file that cannot be read. Files are made from the reviews of the default corpus; nothing trains."""

import csv
import io
import json
import os

import pytest

from conftest import read_csv
from textclf.data.reading import load_table
from textclf.errors import InputError


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


@pytest.mark.parametrize("damage", ["truncated tokenizer.json", "truncated vocab.txt", "missing vocab.txt",
                                    "missing learnt_files.json", "planted added_tokens.json"])
def test_a_damaged_tokenizer_cache_is_one_line_and_learnt_again_once_deleted(tmp_path, damage):
    """A learnt tokenizer is cached with the sha256 of its files: a damaged one is refused, naming the folder, not
    loaded as another vocabulary (a truncated vocab.txt loads without a word) or failed on in the tokenizers
    library. The record is required (without it, ids swapped would load without a word), and a file it does not
    name, which loading would read all the same, is refused too."""
    import shutil

    from textclf.errors import InputError
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


def test_the_held_out_split_nobody_asked_for_is_capped_and_one_asked_for_is_not(capsys):
    """10%, at most 10,000 examples, said once; a fraction or a number of examples asked for is held out whole.
    The same draw every time: a resume and the report rebuild it."""
    from datasets import Dataset

    from textclf.data.examples import hold_out
    from textclf.tasks.task import Task

    task = Task.of("single_label", "review", "label")
    table = Dataset.from_dict({"text": [f"评论{i}" for i in range(120_000)], "labels": [i % 3 for i in range(120_000)]})
    names = ["a", "b", "c"]
    train, held = hold_out(table, names, "big.csv", task, None, 0)
    assert (len(train), len(held)) == (110_000, 10_000)
    assert sorted(set(held["labels"])) == [0, 1, 2] and held["labels"].count(0) in (3333, 3334)
    assert capsys.readouterr().out == ("eval: 10,000 examples (10%, at most 10,000; --eval_split asks for more) of "
                                       "big.csv held out, stratified by label\n")
    assert hold_out(table, names, "big.csv", task, None, 0)[1]["text"] == held["text"]
    for asked, size in ((0.2, 24_000), (30_000.0, 30_000)):
        assert len(hold_out(table, names, "big.csv", task, asked, 0)[1]) == size
    small = table.select(range(5_000))
    assert len(hold_out(small, names, "small.csv", task, None, 0)[1]) == 500
    capsys.readouterr()
    with pytest.raises(InputError, match="cannot hold out 5,000 examples of small.csv: it has 5,000 examples"):
        hold_out(small, names, "small.csv", task, 5_000.0, 0)


@pytest.mark.parametrize("eval_split, valid", [(0.5, True), (2500, True), (1, True), (0, False), (1.5, False),
                                               (-3, False)])
def test_eval_split_is_a_fraction_or_a_number_of_examples(eval_split, valid):
    from textclf.config import TrainConfig

    if valid:
        assert TrainConfig(eval_split=eval_split).eval_split == eval_split
    else:
        with pytest.raises(InputError, match="eval_split must be a fraction in .0, 1. or a whole number of examples"):
            TrainConfig(eval_split=eval_split)


@pytest.mark.parametrize("kind, columns, rows", [
    ("single_label", ("review", "stars"), [{"review": "好", "stars": 2}, {"review": "差", "stars": 10},
                                           {"review": "还行", "stars": 2}]),
    ("multi_label", ("review", "tags"), [{"review": "好", "tags": ["味道", "服务"]}, {"review": "差", "tags": []},
                                         {"review": "慢", "tags": ["配送"]}]),
    ("regression", ("review", "score"), [{"review": "好", "score": 4.3}, {"review": "差", "score": 1.1}]),
    ("single_label", ("query", "label", "answer"), [{"query": "问", "answer": "答", "label": "yes"},
                                                    {"query": "问2", "answer": "答2", "label": "no"}]),
])
def test_written_examples_are_the_data_s_columns_and_read_back_as_the_same_examples(tmp_path, kind, columns, rows):
    from textclf.data.examples import read_labelled, write_examples
    from textclf.tasks.task import Task

    task = Task.of(kind, *columns)
    source = write(tmp_path / "data.jsonl", json_lines(rows).encode())
    table, names = read_labelled(source, task)
    (tmp_path / "elsewhere").write_text("untouched")
    os.symlink(tmp_path / "elsewhere", tmp_path / "eval.jsonl.tmp")  # a link at the temporary name is not followed
    write_examples(table, task, names, str(tmp_path / "eval.jsonl"))
    assert (tmp_path / "elsewhere").read_text() == "untouched" and not os.path.lexists(tmp_path / "eval.jsonl.tmp")
    written = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [set(row) for row in written] == [set(row) for row in rows]
    assert [row[task.label_column] for row in written] == [
        str(row[task.label_column]) if kind == "single_label" else row[task.label_column] for row in rows]
    again, _ = read_labelled(str(tmp_path / "eval.jsonl"), task, names=names)
    assert again.to_dict() == table.to_dict()


def test_a_text_column_called_text_is_fingerprinted_as_any_other(tmp_path):
    """`datasets` hands a file's own `text` column on as large_string, which Arrow's join did not take."""
    from textclf.data.examples import fingerprint, read_labelled
    from textclf.tasks.task import Task

    rows = "".join(f"{i % 2},评论{i}\n" for i in range(6))
    prints = {column: fingerprint(read_labelled(write(tmp_path / f"{column}.csv", f"stars,{column}\n{rows}".encode()),
                                                Task.of("single_label", column, "stars"))[0])
              for column in ("text", "review")}
    assert prints["text"] == prints["review"]
