"""Tokenizing, cached by `datasets` (a bar: the one data stage that takes minutes), the sample of texts a scratch
tokenizer is learnt from, and what the other ranks of a launch say while the local main process does it.
"""

import os
import random
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import datasets
import pyarrow as pa
import pyarrow.compute as pc
from accelerate import PartialState
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from textclf.errors import say

from .reading import text_columns


def text_sample(table: Dataset, size: int, seed: int) -> Iterator[list[str]]:
    """Batches of the texts a scratch tokenizer learns from: both texts of `size` examples drawn with `seed`
    (every example when `size` is 0 or the table is smaller), read a batch at a time, never all at once."""
    if 0 < size < len(table):
        table = table.select(sorted(random.Random(seed).sample(range(len(table)), size)))
    for batch in table.select_columns(text_columns(table)).iter(batch_size=1000):
        yield from batch.values()


def sample_key(data_fingerprint: str, rows: int, size: int, seed: int) -> str:
    """What names the texts that text_sample draws from `rows` examples with this fingerprint, for caches."""
    return f"{data_fingerprint}-all" if not 0 < size < rows else f"{data_fingerprint}-sample{size}-seed{seed}"


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
    by `datasets`. Token types are kept only where they say something (a pair's, or a family that marks single
    texts too) and the model takes them; the collator makes the attention mask as it pads."""
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
    bar = show_progress and PartialState().is_main_process and not datasets.is_progress_bar_enabled()
    if bar:
        datasets.enable_progress_bars()
    try:
        tokenized = table.with_format("arrow").map(encode, batched=True, num_proc=num_proc,
                                                   desc=f"data: tokenizing {len(table):,} examples").with_format(None)
    finally:
        if bar:
            datasets.disable_progress_bars()
    files = [file["filename"] for file in tokenized.cache_files]
    if show_progress and files and all(os.path.getmtime(file) < started for file in files):
        say(f"data: {len(table):,} examples tokenized before, from the cache ({os.path.dirname(files[0])})")
    elif show_progress:
        say(f"data: tokenized {len(table):,} examples in {time.perf_counter() - start:.1f} s"
            + (f", cached in {os.path.dirname(files[0])}" if files else ""))
    return tokenized


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
