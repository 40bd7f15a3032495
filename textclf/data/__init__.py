"""Data: the user's files read (and why one could not be), the default corpus, labels, the held-out split, cached
tokenizing, and the batches. Knows nothing of models or checkpoints."""

from .batches import EpochLengthGroupedSampler, length_sorted_loader, make_loaders, seed_micro_batch
from .reading import (
    clean_text,
    load_table,
    read_labelled,
    require_text_column,
    select_columns,
)
from .splits import fingerprint, load_splits, write_examples
from .tokenized import sample_key, text_sample, tokenize, tokenizing_processes, waiting

__all__ = [
    "EpochLengthGroupedSampler", "clean_text", "fingerprint", "length_sorted_loader",
    "load_splits", "load_table", "make_loaders", "read_labelled", "require_text_column", "sample_key",
    "seed_micro_batch", "select_columns", "text_sample", "tokenize", "tokenizing_processes", "waiting",
    "write_examples",
]
