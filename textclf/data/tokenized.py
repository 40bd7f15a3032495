"""Tokenizing, cached by `datasets` (a bar: the one data stage that takes minutes) and checked against the checksums
recorded when the cache was written, the sample of texts a scratch tokenizer is learnt from, and what the other ranks
of a launch say while the local main process does it.
"""

import glob
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Optional

import datasets
import pyarrow as pa
import pyarrow.compute as pc
from accelerate import PartialState
from datasets import Dataset
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from textclf.errors import say

from .reading import cache_problems, one_run_at_a_time, record_checksums, remove_damaged, text_columns


def tokenizing_processes(rows: int) -> Optional[int]:
    """How many processes tokenize `rows` examples: one per core this process may use, each with enough rows to
    pay for its start; None for this process alone."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    processes = min(cores, rows // ROWS_PER_TOKENIZING_PROCESS)
    return processes if processes > 1 else None


ROWS_PER_TOKENIZING_PROCESS = 20_000


def tokenize(table: Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int, num_proc=None,
             show_progress: bool = False) -> Dataset:
    """Token ids plus each example's length, a pair's as one sequence (truncated longest first), cached on disk
    by `datasets`, a cache trusted only as it was written (drop_damaged). Token types are kept only where they say
    something (a pair's, or a family that marks single texts too) and the model takes them; the collator makes the
    attention mask as it pads."""
    texts = text_columns(table)
    pairs = "text_pair" in texts
    types = None if pairs or any(tokenizer("x").get("token_type_ids", [])) else False  # None: if the model takes them
    ids_type = pa.list_(pa.int32())

    def encode(batch: pa.Table) -> pa.Table:  # Arrow in and out: no per-row Python past the tokenizer's lists
        pair = batch["text_pair"].to_pylist() if pairs else None
        encoded = tokenizer(batch["text"].to_pylist(), pair, truncation=True, max_length=max_length,
                            return_attention_mask=False, return_token_type_ids=types)
        ids = pa.array(encoded["input_ids"], ids_type)
        batch = batch.drop_columns(texts).append_column("input_ids", ids)
        if "token_type_ids" in encoded:
            batch = batch.append_column("token_type_ids", pa.array(encoded["token_type_ids"], pa.list_(pa.int8())))
        return batch.append_column("length", pc.list_value_length(ids))

    start, started = time.perf_counter(), time.time()
    table = table.with_format("arrow")
    cache = cache_file(table, encode.__code__.co_code, tokenizer, max_length, types, pairs)
    # Under a launch the local main process tokenizes before the others: it alone checks the cache and rebuilds
    # what is damaged, so that the others read what it checked. Another run on the same data (a sweep, another
    # node on shared storage) waits for it: a file it is writing has no record yet, and is not damaged.
    checking = cache is not None and PartialState().is_local_main_process
    with one_run_at_a_time(cache) if checking else nullcontext():
        trusted = drop_damaged(cache) if checking else set()
        named = {} if cache is None else {"cache_file_name": cache, "new_fingerprint": cache_key(cache)}
        bar = show_progress and PartialState().is_main_process and not datasets.is_progress_bar_enabled()
        if bar:
            datasets.enable_progress_bars()
        try:
            tokenized = table.map(encode, batched=True, num_proc=num_proc,
                                  desc=f"data: tokenizing {len(table):,} examples", **named).with_format(None)
        finally:
            if bar:
                datasets.disable_progress_bars()
        cached = [file["filename"] for file in tokenized.cache_files]
        if checking:
            record_checksums([file for file in files_of(cache) if file in cached and file not in trusted],
                             TOKENIZED)
    if show_progress and cached and all(os.path.getmtime(file) < started for file in cached):
        say(f"data: {len(table):,} examples tokenized before, from the cache ({os.path.dirname(cached[0])})")
    elif show_progress:
        say(f"data: tokenized {len(table):,} examples in {time.perf_counter() - start:.1f} s"
            + (f", cached in {os.path.dirname(cached[0])}" if cached else ""))
    return tokenized


def cache_file(table: Dataset, code: bytes, tokenizer: PreTrainedTokenizerBase, *options) -> Optional[str]:
    """The file `datasets` caches `table` tokenized in, beside the table's own cache files (with several tokenizing
    processes, one file per process: its name plus a suffix), named by what decides its content: the table, the
    tokenizing function's `code` and `options`, and what the tokenizer does, not where it was loaded from (a resume
    loads the same tokenizer from its checkpoint). None where nothing is cached for a later run: a table in memory,
    or caching turned off."""
    if not (table.cache_files and datasets.is_caching_enabled()):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer, the whole of it as JSON
    does = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    key = Hasher.hash([table._fingerprint, code, does, tokenizer.all_special_tokens, *options])
    return os.path.join(os.path.dirname(table.cache_files[0]["filename"]), f"cache-{key}.arrow")


def cache_key(cache: str) -> str:
    """The tokenized table's fingerprint: its cache file's key."""
    return os.path.basename(cache).removeprefix("cache-").removesuffix(".arrow")


TOKENIZED = "tokenized examples"


def files_of(cache: str) -> list[str]:
    """The files `datasets` wrote for `cache`: the file, or one per tokenizing process."""
    prefix, ext = os.path.splitext(cache)
    return sorted(glob.glob(glob.escape(prefix) + "*" + ext))


def drop_damaged(cache: str) -> set[str]:
    """The files of `cache` that hold what was written to them (their size and sha256 are those recorded beside
    them). The others are removed, with their records, and said in one line: `datasets` then tokenizes again what
    they held, never reads them."""
    found = files_of(cache)
    problems = cache_problems(found)
    if problems:
        remove_damaged(problems, TOKENIZED, "tokenizing again")
    return set(found) - set(problems)


# How long a rank waits before it says what for, and again as often. TEXTCLF_WAIT_NOTE_S overrides it (the tests).
WAIT_NOTE_S = 60.0


@contextmanager
def waiting(who: str, what: str):
    """Say that `who` waits for `what`, then again every WAIT_NOTE_S seconds until the block ends: a thread does,
    as a process blocked in a barrier cannot."""
    print(f"{who}: waiting for {what}; then reading both from its caches", flush=True)
    every_s = float(os.environ.get("TEXTCLF_WAIT_NOTE_S", WAIT_NOTE_S))
    done, start = threading.Event(), time.perf_counter()

    def note():
        while not done.wait(every_s):
            print(f"{who}: still waiting for {what} ({time.perf_counter() - start:.0f} s so far)", flush=True)

    thread = threading.Thread(target=note, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
