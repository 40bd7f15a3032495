"""What one training job is made of: its data, tokenizer and model, built from the config in one way
for train.py, the benchmark and its baselines, so that all of them train the same thing."""

import os
import threading
import time
from contextlib import ExitStack, contextmanager, nullcontext
from typing import NamedTuple

from accelerate import PartialState
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .config import TrainConfig
from .data import fingerprint, load_splits, sample_key, text_sample, tokenize, tokenizing_processes
from .modeling import get_tokenizer, lora_settings, make_model, model_config, scratch_size, training_config
from .task import Task


class Job(NamedTuple):
    train_set: Dataset  # tokenized: labels, input_ids (token_type_ids for pairs), length
    eval_set: Dataset
    label_names: list[str]
    tokenizer: PreTrainedTokenizerBase
    model: PreTrainedModel  # with LoRA adapters when cfg.lora
    data_fingerprint: str  # of the training examples, for resume to recognise them
    eval_examples: Dataset  # the eval set as read (text, text_pair for pairs, labels), for the run to write out


def load_data(cfg: TrainConfig) -> tuple[Dataset, Dataset, list[str], str]:
    """The train and eval splits (columns `text`, `text_pair` for pairs, `labels`), the label names, and the
    training examples' fingerprint, as every run of `cfg` sees them."""
    train_set, eval_set, label_names = load_splits(cfg.data, cfg.eval_data, Task.from_config(cfg), cfg.eval_split,
                                                   cfg.seed, cfg.delimiter, cfg.encoding)
    return train_set, eval_set, label_names, fingerprint(train_set)


def build_job(cfg: TrainConfig, tokenizer_first=nullcontext) -> Job:
    """Data, tokenizer and model for `cfg`; the model's initial weights follow the global seed.

    `tokenizer_first` is the context in which the tokenizer is learnt and the data tokenized, such
    as `accelerator.local_main_process_first`: the other processes then find both in the caches.
    Everything the user can get wrong here is an InputError, raised before anything is written.
    """
    config = model_config(cfg.model, cfg.max_length, cfg.trust_remote_code)  # a model it cannot train stops here
    train_set, eval_set, label_names, data_fingerprint = load_data(cfg)
    eval_examples = eval_set
    state = PartialState()
    what = (f"the local main process to prepare the tokenizer and tokenize {len(train_set):,} + {len(eval_set):,} "
            "examples")
    with ExitStack() as first:
        with nullcontext() if state.is_local_main_process else waiting(f"process {state.process_index}", what):
            first.enter_context(tokenizer_first())
        texts = text_sample(train_set, cfg.tokenizer_sample, cfg.seed)
        texts_key = sample_key(data_fingerprint, len(train_set), cfg.tokenizer_sample, cfg.seed)
        tokenizer = get_tokenizer(cfg.model, texts, cfg.cache_dir, texts_key, cfg.max_length, cfg.trust_remote_code)
        train_set, eval_set = (tokenize(split, tokenizer, cfg.max_length, num_proc=tokenizing_processes(len(split)),
                                        show_progress=True) for split in (train_set, eval_set))
    config = training_config(cfg.model, tokenizer, Task.from_config(cfg).head_config(label_names), cfg.max_length,
                             config=config, trust_remote_code=cfg.trust_remote_code)
    model = make_model(config, None if scratch_size(cfg.model) else cfg.model, lora=lora_settings(cfg),
                       torch_dtype=cfg.torch_dtype, gradient_checkpointing=cfg.gradient_checkpointing,
                       trust_remote_code=cfg.trust_remote_code)
    return Job(train_set, eval_set, label_names, tokenizer, model, data_fingerprint, eval_examples)


# The other ranks are silent while the local main process prepares the data, minutes for millions of rows: past
# this, a rank says what it waits for, and again as often. TEXTCLF_WAIT_NOTE_S overrides it (the tests).
WAIT_NOTE_S = 60.0


@contextmanager
def waiting(who: str, what: str):
    """Say that `who` waits for `what`, then again every WAIT_NOTE_S seconds until the block ends: a process
    blocked in a barrier cannot say it itself, so a thread does, sleeping between its notes."""
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
