"""Data: reading the user's files, labels, the split, tokenizing, batching. Knows nothing of models or checkpoints;
what the user can get wrong here is an `InputError` before any output is written. Progress is a line per stage
(errors.say), and a bar for tokenizing, the one stage that takes minutes (textclf/quiet.py turns the rest off)."""

import codecs
import hashlib
import json
import math
import os
import random
import re
import time
import warnings
from pathlib import Path
from typing import Iterator, Optional

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from accelerate import PartialState
from datasets import Dataset
from datasets.utils.stratify import stratified_shuffle_split_generate_indices
from torch.utils.data import DataLoader, Sampler
from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase
from transformers.trainer_pt_utils import get_length_grouped_indices

from . import files
from .config import DATA_FORMATS, DEFAULT_DATA, require_data
from .errors import InputError, say
from .task import Task


def clean_text(text) -> str:
    """Real files carry byte-order marks inside fields and stray whitespace."""
    return (text or "").replace("\ufeff", "").strip()


def load_table(path: str, delimiter: Optional[str] = None, encoding: Optional[str] = None) -> Dataset:
    """Read one file or `datasets` folder into a Dataset, or say in one line why it cannot be read
    (textclf/data_errors.py, after a failed read: a file is read once when it loads)."""
    if encoding:  # before the default corpus is built: a mistyped flag costs nothing
        try:
            codecs.lookup(encoding)
        except LookupError:
            raise InputError(f"--encoding {encoding}: not an encoding Python knows; give the file's encoding, e.g. "
                             "utf-8, gb18030, big5, shift_jis or latin-1") from None
    if path == DEFAULT_DATA and not os.path.exists(path):
        from .default_corpus import build_default_corpus

        build_default_corpus(path)
    require_data(path)
    if os.path.isdir(path):
        table = load_folder(path)
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
            from .data_errors import read_again_or_refuse

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


def load_folder(path: str) -> Dataset:
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
        from .data_errors import utf8_copy

        path = utf8_copy(path, encoding)  # the json builder decodes a JSON array as UTF-8 whatever it is told
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        table = datasets.load_dataset(builder, data_files=path, split="train", **options)
    except datasets.exceptions.DatasetGenerationError as e:  # it wraps the parser's error: that one is judged
        raise e.__cause__ if isinstance(e.__cause__, PARSER_ERRORS) else e
    finally:
        datasets.logging.set_verbosity(verbosity)
    # pyarrow's JSON reader keeps bytes that are not UTF-8 in its strings; a full check finds them (ms).
    table.data.validate(full=True)
    return table


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
    kept = table.map(cleaned, batched=True, with_indices=True,
                     remove_columns=[c for c in columns if c not in (*texts, "label")])
    if len(kept) < len(table):
        say(f"warning: dropped {len(table) - len(kept)} row(s) with empty text from {path}")
    if len(kept) == 0:
        raise InputError(f"data set {path} is empty: no row has text in column(s) {', '.join(texts.values())}")
    return kept


def text_columns(table: Dataset) -> list[str]:
    """The text columns of a table that select_columns made: `text`, and `text_pair` for pairs."""
    return [column for column in ("text", "text_pair") if column in table.column_names]


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


class EpochLengthGroupedSampler(Sampler):
    """An epoch's examples in whole global batches, drawn from (seed, epoch, global batch) alone, never from how
    the global batch is split (`accelerate.prepare` deals its micro-batches out to the processes in turn): a
    checkpoint resumes on another number of processes at the same example, and replays its batches. The examples
    left over (fewer than one global batch) sit out the epoch, a different draw each epoch.

    With `group_by_length`, each global batch is one of the Trainer's length groups, shuffled whole: the Trainer's
    order walks each megabatch from its longest group to its shortest, which sweeps the label mix back and forth
    where length goes with the label, and a scratch model stayed at chance for epochs. The group with the longest
    example stays first, so an out-of-memory batch shows at once. No library sampler orders groups this way.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int, group_by_length: bool = True):
        self.lengths, self.batch_size, self.seed, self.epoch = lengths, batch_size, seed, 0
        self.group_by_length = group_by_length

    def __len__(self) -> int:
        return max(len(self.lengths) // self.batch_size, 1) * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        drawn = torch.randperm(len(self.lengths), generator=generator).tolist()
        kept = (drawn * math.ceil(len(self) / len(drawn)))[:len(self)]
        if not self.group_by_length:
            return iter(kept)
        grouped = [kept[i] for i in get_length_grouped_indices([self.lengths[i] for i in kept], self.batch_size,
                                                               generator=generator)]
        groups = [grouped[i:i + self.batch_size] for i in range(0, len(grouped), self.batch_size)]
        rest = [groups[1 + i] for i in torch.randperm(len(groups) - 1, generator=generator).tolist()]
        return iter([i for group in groups[:1] + rest for i in group])


def micro_batch_seed(seed: int, step: int, micro_batch: int) -> int:
    """The RNG seed for one micro-batch's dropout, from its place in the run (optimizer step, and accumulation
    index x processes + rank): whichever rank runs it, and the whole of the RNG state a resume needs."""
    digest = hashlib.sha256(f"{seed}/{step}/{micro_batch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a generator takes up to 2**63 - 1


def seed_micro_batch(seed: int, step: int, micro_batch: int, device: torch.device) -> None:
    """Seed the CPU's generator and the GPU's one micro-batch draws from; torch.manual_seed would seed every
    device type torch knows of, at each micro-batch."""
    value = micro_batch_seed(seed, step, micro_batch)
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)  # the current device's generator


class Collator(DataCollatorWithPadding):
    """transformers' DataCollatorWithPadding, less the attention mask of a batch without padding: given one,
    transformers asks the device whether it masks anything (masking_utils, for SDPA's fastest kernels), a wait for
    the GPU in every forward. A model given no mask computes what it does with a mask of all ones."""

    def __call__(self, features):
        batch = super().__call__(features)
        lengths = {len(feature["input_ids"]) for feature in features}
        if len(lengths) == 1 and lengths.pop() == batch["input_ids"].shape[1]:  # no row was padded
            del batch["attention_mask"]
        return batch


def make_loaders(train: Dataset, held_out: Dataset, tokenizer, *, train_batch_size: int, eval_batch_size: int,
                 num_processes: int, group_by_length: bool, seed: int, gradient_accumulation_steps: int = 1,
                 pad_to_multiple_of=None, pin_memory: bool = False, num_workers: int = 0):
    """Training and evaluation DataLoaders, before `accelerator.prepare` shards them. Each owns its generator:
    otherwise every new iterator draws a seed from the global RNG. `pin_memory` (a GPU's): batches are copied
    from page-locked memory while the device works."""
    collate = Collator(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
    generator = torch.Generator().manual_seed(seed)
    lengths, train = train["length"][:], train.remove_columns(["length"])  # [:] reads the column once
    sampler = EpochLengthGroupedSampler(lengths, train_batch_size * num_processes * gradient_accumulation_steps,
                                        seed, group_by_length)
    train_loader = DataLoader(train, batch_size=train_batch_size, sampler=sampler, collate_fn=collate,
                              generator=generator, pin_memory=pin_memory, num_workers=num_workers)
    eval_loader = length_sorted_loader(held_out, tokenizer, eval_batch_size, pad_to_multiple_of, pin_memory,
                                       num_workers)
    return train_loader, eval_loader


def length_sorted_loader(table: Dataset, tokenizer, batch_size: int, pad_to_multiple_of=None,
                         pin_memory: bool = False, num_workers: int = 0) -> DataLoader:
    """Batches of a tokenized table, longest first (little padding; a batch too big for memory fails at once),
    for evaluation and prediction: keep an index column to put results back in input order."""
    with warnings.catch_warnings():  # pyarrow's deprecation inside `datasets`, not ours to fix
        warnings.simplefilter("ignore", FutureWarning)
        table = table.sort("length", reverse=True).remove_columns(["length"])
    collate = Collator(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
    # Its own generator: iterating must not draw from the global RNG (dropout masks, exact resume).
    return DataLoader(table, batch_size=batch_size, collate_fn=collate, generator=torch.Generator(),
                      pin_memory=pin_memory, num_workers=num_workers)
