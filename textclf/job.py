"""What one training job is made of: its data, tokenizer and model, built from the config in one way
for train.py, the benchmark and its baselines, so that all of them train the same thing."""

from contextlib import nullcontext
from typing import NamedTuple

from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .config import TrainConfig
from .data import fingerprint, load_splits, tokenize
from .modeling import apply_lora, build_model, get_tokenizer


class Job(NamedTuple):
    train_set: Dataset  # tokenized: input_ids, attention_mask, labels, length
    eval_set: Dataset
    label_names: list[str]
    tokenizer: PreTrainedTokenizerBase
    model: PreTrainedModel  # with LoRA adapters when cfg.lora
    data_fingerprint: str  # of the training examples, for resume to recognise them


def build_job(cfg: TrainConfig, tokenizer_first=nullcontext) -> Job:
    """Data, tokenizer and model for `cfg`; the model's initial weights follow the global seed.

    `tokenizer_first` is the context in which the tokenizer is learnt and the data tokenized, such
    as `accelerator.local_main_process_first`: the other processes then find both in the caches.
    Everything the user can get wrong here is an InputError, raised before anything is written.
    """
    train_set, eval_set, label_names = load_splits(cfg.data, cfg.eval_data, cfg.text_column, cfg.label_column,
                                                   cfg.eval_split, cfg.seed, cfg.delimiter, cfg.encoding)
    data_fingerprint = fingerprint(train_set)
    with tokenizer_first():
        tokenizer = get_tokenizer(cfg.model, train_set["text"], cfg.cache_dir, data_fingerprint, cfg.max_length)
        train_set, eval_set = (tokenize(split, tokenizer, cfg.max_length) for split in (train_set, eval_set))
    model = build_model(cfg.model, tokenizer, label_names, cfg.max_length)
    if cfg.lora:  # before prepare: DDP and DeepSpeed must see which parameters train
        model = apply_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
    return Job(train_set, eval_set, label_names, tokenizer, model, data_fingerprint)
