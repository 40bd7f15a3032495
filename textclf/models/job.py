"""A training job's data, tokenizer and model, built from the config in one way for train.py, the benchmark and its
baselines, so that all of them train the same thing.
"""

from contextlib import ExitStack, nullcontext
from typing import NamedTuple, Optional

from accelerate import PartialState
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from textclf.checkpointing import Start
from textclf.config import TrainConfig
from textclf.data import fingerprint, load_splits, tokenize, tokenizing_processes, waiting
from textclf.launch import refuse_float16_weights
from textclf.tasks import Task

from .build import lora_settings, make_model, model_config, scratch_size, training_config
from .tokenizer import get_tokenizer, sample_key, text_sample


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
    training examples' fingerprint."""
    train_set, eval_set, label_names = load_splits(cfg.data, cfg.eval_data, Task.from_config(cfg), cfg.eval_split,
                                                   cfg.seed, cfg.delimiter, cfg.encoding)
    return train_set, eval_set, label_names, fingerprint(train_set)


def build_job(cfg: TrainConfig, tokenizer_first=nullcontext, start: Optional[Start] = None) -> Job:
    """Data, tokenizer and model for `cfg`, the model's initial weights from the global seed; all the user can get
    wrong here is an InputError, raised before anything is written.

    `tokenizer_first` (such as `accelerator.local_main_process_first`) is the context in which the tokenizer is
    learnt and the data tokenized: the other processes then find both in the caches. `start` (plan_start's): a
    resume takes the tokenizer its checkpoint saved, once verified, whatever --cache_dir holds; a scratch tokenizer
    is learnt for a fresh run alone.
    """
    config = model_config(cfg.model, cfg.max_length, cfg.trust_remote_code)  # a model it cannot train stops here
    if config is not None and cfg.torch_dtype == "auto":  # the weights load in the checkpoint's dtype
        refuse_float16_weights(cfg, str(config.dtype).removeprefix("torch."))
    train_set, eval_set, label_names, data_fingerprint = load_data(cfg)
    eval_examples = eval_set
    state = PartialState()
    with ExitStack() as first:
        if state.is_local_main_process:
            first.enter_context(tokenizer_first())
        else:
            with waiting(f"process {state.process_index}", "the local main process to prepare the tokenizer and "
                         f"tokenize {len(train_set):,} + {len(eval_set):,} examples"):
                first.enter_context(tokenizer_first())
        texts = text_sample(train_set, cfg.tokenizer_sample, cfg.seed)
        texts_key = sample_key(data_fingerprint, len(train_set), cfg.tokenizer_sample, cfg.seed)
        tokenizer = get_tokenizer(cfg.model, texts, cfg.cache_dir, texts_key, cfg.max_length, cfg.trust_remote_code,
                                  saved_in=start.verified_folder("tokenizer") if start else None)
        train_set, eval_set = (tokenize(split, tokenizer, cfg.max_length, num_proc=tokenizing_processes(len(split)),
                                        show_progress=True) for split in (train_set, eval_set))
    config = training_config(cfg.model, tokenizer, Task.from_config(cfg).head_config(label_names), cfg.max_length,
                             config=config, trust_remote_code=cfg.trust_remote_code)
    model = make_model(config, None if scratch_size(cfg.model) else cfg.model, lora=lora_settings(cfg),
                       torch_dtype=cfg.torch_dtype, gradient_checkpointing=cfg.gradient_checkpointing,
                       trust_remote_code=cfg.trust_remote_code)
    return Job(train_set, eval_set, label_names, tokenizer, model, data_fingerprint, eval_examples)
