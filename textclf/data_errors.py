"""Why a data file could not be read, said in one line: its encoding (a Chinese file that is not UTF-8 is read
again as GB18030, with a note), or where its structure breaks (a CSV line with more fields than the header, a JSON
Lines line that is not an object) and what to do. data.load_table imports this only when a read has failed, or to
read a JSON file in an encoding other than UTF-8 (utf8_copy).
"""

import codecs
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

import datasets

from .config import DATA_FORMATS
from .data import PARSER_ERRORS, empty, read_file
from .errors import InputError, say


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
