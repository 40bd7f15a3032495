"""Data: the user's files read (and why one could not be), the default corpus, labels, the held-out split, cached
tokenizing, and the batches. Knows nothing of models or checkpoints."""

from .batches import EpochLengthGroupedSampler, length_sorted_loader, make_loaders, seed_micro_batch
from .examples import fingerprint, load_splits, read_labelled, write_examples
from .reading import (
    clean_text,
    load_table,
    require_text_column,
    select_columns,
    text_columns,
)
from .tokenized import tokenize, tokenizing_processes, waiting

__all__ = [
    "clean_text", "EpochLengthGroupedSampler", "fingerprint", "length_sorted_loader", "load_splits", "load_table",
    "make_loaders", "read_labelled", "require_text_column", "seed_micro_batch", "select_columns", "text_columns",
    "tokenize", "tokenizing_processes", "waiting", "write_examples",
]
