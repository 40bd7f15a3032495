"""A run's labelled examples: the labels read, checked and encoded by the task, the held-out split (stratified, from
the seed), the examples a run evaluated written out for the report, and the fingerprint a resume recognises the
training data by.
"""

import hashlib
import json
import math
import time
from typing import Optional

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset
from datasets.utils.stratify import stratified_shuffle_split_generate_indices

from textclf import files
from textclf.errors import InputError, say
from textclf.tasks import Task

from .reading import load_table, select_columns, text_columns


def load_splits(data: str, eval_data, task: Task, eval_split: Optional[float], seed: int,
                delimiter: Optional[str] = None, encoding: Optional[str] = None):
    """The train and eval Datasets (columns `text`, `text_pair` for pairs, `labels`) and the label names."""
    start = time.perf_counter()
    table = select_columns(load_table(data, delimiter, encoding), data, task)
    say(f"data: read {data}: {len(table):,} rows in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    train, names = labelled(table, data, task)
    if eval_data:
        held_out, _ = read_labelled(eval_data, task, delimiter, encoding, names)
    else:
        train, held_out = hold_out(train, names, data, task, eval_split, seed)
    say(f"data: labels and split: {len(train):,} train / {len(held_out):,} eval examples in "
        f"{time.perf_counter() - start:.1f} s")
    return train, held_out, names


def read_labelled(path: str, task: Task, delimiter: Optional[str] = None, encoding: Optional[str] = None,
                  names: Optional[list[str]] = None):
    """(The task's examples in a data file, the label names)."""
    return labelled(select_columns(load_table(path, delimiter, encoding), path, task), path, task, names)


def labelled(table: Dataset, path: str, task: Task, names: Optional[list[str]] = None):
    """(`table` with its labels encoded as the `labels` column, the label names: the table's own unless given, as
    a held-out or report file must use the training data's)."""
    labels = task.parse_labels(table["label"][:], path, table["row"][:])
    names = names or task.label_names(labels, path)
    encoded, feature = task.encode_labels(labels, names, path)
    # As an Arrow array: `datasets` fingerprints the new column by pickling it, which is slow for a long list.
    encoded = pa.array(encoded, datasets.Features({"labels": feature}).arrow_schema.field("labels").type)
    return table.remove_columns(["label", "row"]).add_column("labels", encoded, feature=feature), names


# The held-out split nobody asked for: a fraction of the data, up to a size whose scores are precise enough (a
# standard error of accuracy under 0.5 points) and whose evaluation takes seconds, not minutes.
DEFAULT_EVAL_FRACTION, DEFAULT_EVAL_MAX = 0.1, 10_000


def held_out_size(eval_split: Optional[float], examples: int) -> tuple[int, str]:
    """(How many of `examples` to hold out, how to say it), from `eval_split` (a fraction or a count) or the
    defaults."""
    if eval_split is None:
        size = min(math.ceil(DEFAULT_EVAL_FRACTION * examples), DEFAULT_EVAL_MAX)
        capped = size < math.ceil(DEFAULT_EVAL_FRACTION * examples)
        return size, (f"{size:,} examples ({DEFAULT_EVAL_FRACTION:.0%}, at most {DEFAULT_EVAL_MAX:,}; "
                      "--eval_split asks for more)" if capped else f"{DEFAULT_EVAL_FRACTION:.0%} ({size:,} examples)")
    if eval_split < 1:
        size = math.ceil(eval_split * examples)
        return size, f"{eval_split:.0%} ({size:,} examples)"
    return int(eval_split), f"{int(eval_split):,} examples"


def hold_out(train: Dataset, names: list[str], path: str, task: Task, eval_split: Optional[float], seed: int):
    """Split off `eval_split` of the examples (held_out_size), stratified as the task says it can be, and say how."""
    held_out, what = held_out_size(eval_split, len(train))
    if held_out >= len(train):
        raise InputError(f"cannot hold out {what} of {path}: it has {len(train):,} examples; ask for fewer with "
                         "--eval_split, or give a held-out file with --eval_data")
    strata, how = task.strata(train["labels"][:], held_out, names, f"cannot hold out {what} of {path}")
    say(f"eval: {what} of {path} held out, {how}")
    if strata is None:
        split = train.train_test_split(test_size=held_out, seed=seed)
        return split["train"], split["test"]
    stratum_id = {stratum: i for i, stratum in enumerate(sorted(set(strata)))}
    # train_test_split(stratify_by_column=...)'s own draw, given the strata in memory: it reads a column row by row.
    try:
        kept, held = next(stratified_shuffle_split_generate_indices(
            np.array([stratum_id[stratum] for stratum in strata]), len(train) - held_out, held_out,
            rng=np.random.default_rng(seed)))
    except ValueError as e:
        raise InputError(f"cannot hold out {what} of {path} {how}: {e}; give a held-out file with "
                         "--eval_data") from None
    return train.select(kept), train.select(held)


def write_examples(table: Dataset, task: Task, names: list[str], path: str) -> None:
    """The examples of a table that load_splits made, as JSON Lines in the data's own columns and label names
    (Task.cell), which --data, --eval_data and the report read back as the same examples."""
    columns = task.text_columns
    advice = "free space or make the folder writable, then run again"
    with files.replacing(path, encoding="utf-8", advice=advice) as f:
        for batch in table.select_columns([*columns, "labels"]).iter(batch_size=1000):
            for i, label in enumerate(batch["labels"]):
                row = {column: batch[name][i] for name, column in columns.items()}
                f.write(json.dumps({**row, task.label_column: task.cell(label, names)}, ensure_ascii=False) + "\n")


def fingerprint(table: Dataset) -> str:
    """A digest of the examples (labels and texts, in order), so a checkpoint can tell whether it sees the same
    data; hashed a batch at a time in Arrow, not row by row in Python."""
    digest = hashlib.sha256()
    columns = text_columns(table)
    for batch in table.select_columns(["labels", *columns]).with_format("arrow").iter(batch_size=65536):
        digest.update(json.dumps(batch["labels"].to_pylist()).encode())
        for column in columns:
            # A file's own `text` column comes through select_columns as large_string: hashed as string, the same
            # examples give the same fingerprint whatever their column was called.
            texts = batch[column].combine_chunks().cast(pa.string())
            digest.update(pc.binary_length(texts).to_numpy().tobytes())  # where each text ends
            digest.update(pc.binary_join(pa.ListArray.from_arrays([0, len(texts)], texts), "")[0].as_buffer())
    return digest.hexdigest()[:16]
