"""Models: the one factory (make_model) that builds every model, to train, to read back, for the check
and for the export; the offline default (a BERT built from config and a tokenizer learnt from the texts),
anything `from_pretrained` loads, LoRA, AdamW's parameter groups."""

import json
import logging
import os
import pickle
import re
import shutil
import time
import warnings
from contextlib import contextmanager, nullcontext
from typing import Optional

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertTokenizerFast,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
from transformers.models.auto.tokenization_auto import get_tokenizer_config

from .checkpoint import sha256
from .errors import InputError, say, verbose

# The class of every model here (make_model), and the configs it has a class for (model_config): a fork that
# wants another kind of head changes these two lines alone.
MODEL_CLASS = AutoModelForSequenceClassification
MODEL_CLASS_MAPPING = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

# Sizes of Google's BERT miniatures (Turc et al., 2019) and BERT-base.
SCRATCH_SIZES = {
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2),
    "mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4),
    "small": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8),
    "medium": dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8),
    "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12),
}
SCRATCH_VOCAB_SIZE = 8000
# Parameter names that take no weight decay, as the Trainer names them (Trainer.get_decay_parameter_names).
NO_DECAY_NAME_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def scratch_size(model: str):
    """'scratch-mini' -> 'mini'; None for a hub id or folder."""
    if not model.startswith("scratch-"):
        return None
    size = model.removeprefix("scratch-")
    if size not in SCRATCH_SIZES:
        raise InputError(f"unknown model size '{model}' (expected scratch-{{{','.join(SCRATCH_SIZES)}}})")
    return size


def model_config(model: str, max_length: int, trust_remote_code: bool = False) -> Optional[PretrainedConfig]:
    """The config of a pretrained `model`, read before any weight and checked: its code is transformers' own
    unless trusted, it has a sequence-classification class, and it has positions for `max_length`
    tokens. None for a scratch model (its config is `scratch_config`)."""
    if scratch_size(model):
        return None
    try:
        # trust_remote_code=False, never None: None would prompt on a terminal for a repo that ships code.
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise load_refused(model, e, f"cannot read the config of model '{model}'") from None
    auto_map = getattr(config, "auto_map", None) or {}
    refuse_custom_code(model, auto_map, trust_remote_code)
    refuse_custom_code(model, get_tokenizer_config(model).get("auto_map"), trust_remote_code)  # before the data
    custom_head = trust_remote_code and MODEL_CLASS.__name__ in auto_map
    if type(config) not in MODEL_CLASS_MAPPING and not custom_head:
        raise InputError(f"'{model}' is a {config.model_type} model, and transformers has no sequence-classification "
                         f"class for {config.model_type} (AutoModelForSequenceClassification); choose a model of "
                         "another family (BERT, RoBERTa, Llama, Qwen2, GPT-2, ...)")
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and max_length > positions:
        raise InputError(f"--max_length {max_length} is beyond the {positions} positions of '{model}' "
                         f"(max_position_embeddings); use --max_length {positions} or less")
    return config


def needs_remote_code(model: str) -> InputError:
    """What transformers' refusal of a model's own code (trust_remote_code=False) says to the user."""
    return InputError(f"'{model}' needs custom code to load (its config's auto_map names Python files it ships); "
                      "pass --trust_remote_code if you trust that code")


def refuse_custom_code(source: str, auto_map: Optional[dict], trust_remote_code: bool) -> None:
    """A config or tokenizer whose auto_map names its own code needs trust_remote_code even where transformers
    knows its type (`bert`): there transformers would silently load its own class in place of the folder's."""
    if auto_map and not trust_remote_code:
        raise needs_remote_code(source)


def load_refused(model: str, error: Exception, problem: str) -> InputError:
    """One line for what transformers raised loading `model`: its own code refused, or `problem` and the cause."""
    if "trust_remote_code" in str(error):
        return needs_remote_code(model)
    return InputError(f"{problem}: {(str(error).splitlines() or [type(error).__name__])[0]}")


def get_tokenizer(model: str, texts, cache_dir: str, texts_key: str, max_length: int,
                  trust_remote_code: bool = False):
    """The model's tokenizer, ready to pad batches; for a scratch model, one learnt from `texts` (strings or
    batches of them) and cached under `texts_key`, which names those texts (data.sample_key).

    Call it on the local main process first: the others then find the cached one.
    """
    if not scratch_size(model):
        try:
            # padding_side as a loading argument, not set afterwards: only then does save_pretrained keep it.
            tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code, padding_side="right")
        except (OSError, ValueError) as e:
            raise load_refused(model, e, f"cannot load a tokenizer from '{model}'") from None
        refuse_custom_code(model, tokenizer.init_kwargs.get("auto_map"), trust_remote_code)
        return with_pad_token(tokenizer, model)
    folder = scratch_tokenizer_folder(cache_dir, texts_key)
    start, learnt = time.perf_counter(), not os.path.isdir(folder)
    if learnt:
        train_tokenizer(texts, folder)
    tokenizer = load_learnt_tokenizer(folder, max_length)
    if learnt:
        say(f"data: learnt a tokenizer of {len(tokenizer):,} tokens in {time.perf_counter() - start:.1f} s, cached "
            f"in {folder}")
    else:
        say(f"data: a tokenizer of {len(tokenizer):,} tokens from the cache, {folder}")
    return tokenizer


def with_pad_token(tokenizer: PreTrainedTokenizerBase, model: str) -> PreTrainedTokenizerBase:
    """The tokenizer with a pad token: the eos token where the family ships none (Llama, Qwen2 and GPT-2
    do not), as their own classification examples set it.

    Padding goes on the right (get_tokenizer): decoder heads classify from the rightmost token that is
    not padding, and count positions from the first token, so padded on the right every text keeps the
    positions it has alone. Some families (Llama's among them) ship left padding, for generation.
    """
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise InputError(f"the tokenizer of '{model}' has neither a pad token nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def scratch_tokenizer_folder(cache_dir: str, texts_key: str) -> str:
    """Where the tokenizer learnt from the texts named by `texts_key` (data.sample_key) is cached."""
    return os.path.join(os.path.expanduser(cache_dir), f"tokenizer-{texts_key}-{SCRATCH_VOCAB_SIZE}")


# In a learnt tokenizer's folder: the sha256 of each of its files, as learnt.
LEARNT_FILES = "learnt_files.json"


def load_learnt_tokenizer(folder: str, max_length: int):
    """The tokenizer learnt into `folder`, refused in one line when its files are not those it was learnt with: a
    damaged cache would otherwise fail in the tokenizers library, or load as another vocabulary without a word.
    A folder cached before the files were recorded is checked by loading it alone."""
    try:
        recorded = {}
        if os.path.exists(os.path.join(folder, LEARNT_FILES)):
            with open(os.path.join(folder, LEARNT_FILES), encoding="utf-8") as f:
                recorded = json.load(f)
        changed = [name for name, digest in recorded.items() if sha256(os.path.join(folder, name)) != digest]
        damage = f"{', '.join(changed)} changed since it was learnt" if changed else None
        if not damage:
            return BertTokenizerFast.from_pretrained(folder, model_max_length=max_length)
    except (OSError, ValueError) as e:  # a file missing or unreadable; JSON that does not parse
        damage = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise InputError(f"the tokenizer cached in {folder} is damaged ({damage}); delete that folder, and the next run "
                     "learns one again from the data")


def train_tokenizer(texts, folder: str) -> None:
    """A BERT WordPiece vocabulary learnt from the texts (every CJK character its own token)."""
    from tokenizers import BertWordPieceTokenizer

    wordpiece = BertWordPieceTokenizer(handle_chinese_chars=True, lowercase=True)
    wordpiece.train_from_iterator(texts, vocab_size=SCRATCH_VOCAB_SIZE, min_frequency=2, show_progress=False)
    tmp = f"{folder}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    wordpiece.save_model(tmp)
    BertTokenizerFast(os.path.join(tmp, "vocab.txt")).save_pretrained(tmp)
    digests = {name: sha256(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
    with open(os.path.join(tmp, LEARNT_FILES), "w", encoding="utf-8") as f:
        json.dump(digests, f, indent=2)
    try:
        os.replace(tmp, folder)
    except OSError:  # another run learnt the same vocabulary from the same texts and put it there first
        if not os.path.isdir(folder):
            raise
        shutil.rmtree(tmp)


def scratch_config(size: str, vocab_size: int, max_length: int, **extra) -> BertConfig:
    """The config of a `scratch-<size>` BERT."""
    return BertConfig(vocab_size=vocab_size, intermediate_size=4 * SCRATCH_SIZES[size]["hidden_size"],
                      max_position_embeddings=max(512, max_length), **SCRATCH_SIZES[size], **extra)


def training_config(model: str, tokenizer, head: dict, max_length: int, *, config: Optional[PretrainedConfig] = None,
                    trust_remote_code: bool = False) -> PretrainedConfig:
    """The config of the model to train: a scratch BERT's, or `model`'s own (`config` when the caller has read
    it already with model_config), carrying the task's head (Task.head_config: the label names of the data
    and the `problem_type` that picks the model's loss) and the tokenizer's pad token."""
    size = scratch_size(model)
    if size:
        return scratch_config(size, len(tokenizer), max_length, pad_token_id=tokenizer.pad_token_id, **head)
    config = config or model_config(model, max_length, trust_remote_code)
    for key, value in head.items():
        setattr(config, key, value)
    config.pad_token_id = tokenizer.pad_token_id  # what decoder heads look for to find each text's last token
    if hasattr(config, "use_cache"):
        config.use_cache = False  # a classifier never generates: no key/value cache to build and keep
    return config


def make_model(config: PretrainedConfig, weights=None, *, lora=None, complete: bool = False,
               source: str = "the trained model", torch_dtype: Optional[str] = None,
               gradient_checkpointing: bool = False, trust_remote_code: bool = False) -> PreTrainedModel:
    """Every model of the project, as a MODEL_CLASS of `config`: to train, to read back, for the check.

    `weights`: None for fresh random ones (a scratch model; none at all under `torch.device("meta")`, the
    check's); a hub id or folder for `from_pretrained` (a backbone to fine-tune, whose new head is said in
    one line, or with `complete` a model folder, which must hold every weight); or a full state dict
    (a step_<N> checkpoint's, an export's copy), which must fit exactly, LoRA's adapters included; `source`
    names it in the refusal.
    `lora`: None; LoRA's settings (apply_lora's keywords) for new adapters; or a folder holding trained
    ones (an exported LoRA folder, whose base `weights` then holds). `torch_dtype` is the dtype the weights
    are loaded and kept in: a name of a torch dtype, or "auto" for the checkpoint's; None for the libraries'
    defaults (from_pretrained: float32; from_config: the config's dtype, the trained model's).
    """
    dtype = {} if torch_dtype in (None, "auto") else {"dtype": getattr(torch, torch_dtype)}
    if isinstance(weights, str):
        model = from_pretrained(weights, config, complete, {"dtype": "auto"} if torch_dtype == "auto" else dtype,
                                trust_remote_code)
    elif type(config) in MODEL_CLASS_MAPPING:
        # The class itself, not from_config: under ZeRO-3 from_config builds the weights already partitioned
        # (deepspeed.zero.Init), drawing other random numbers than DDP or one process from the same seed.
        model = MODEL_CLASS_MAPPING[type(config)](config)
        wanted = dtype.get("dtype", config.dtype)  # from_config's default: the config's own dtype
        if wanted is not None:
            model = model.to(getattr(torch, wanted) if isinstance(wanted, str) else wanted)
    else:  # a folder's own model class (trust_remote_code)
        try:
            model = MODEL_CLASS.from_config(config, trust_remote_code=trust_remote_code, **dtype)
        except ValueError as e:
            raise load_refused(source, e, f"cannot build the model of {source}") from None
    # accelerate's FSDP plugin wraps the classes in `_no_split_modules` when the yaml names none.
    model._no_split_modules = layer_classes(model)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if isinstance(lora, dict):  # before prepare: DDP and DeepSpeed must see which parameters train
        model = apply_lora(model, **lora)
    if isinstance(weights, dict):
        load_weights(model, weights, source)
    if isinstance(lora, str):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, lora)
    return model


def from_pretrained(weights: str, config: PretrainedConfig, complete: bool, dtype: dict,
                    trust_remote_code: bool) -> PreTrainedModel:
    """make_model's `from_pretrained`: a backbone whose new head is said in one line, or with `complete` a model
    folder that must hold every weight; what it cannot load is one line."""
    try:
        with nullcontext() if complete else load_report_as_one_line(weights):
            model, info = MODEL_CLASS.from_pretrained(weights, config=config, ignore_mismatched_sizes=True,
                                                      output_loading_info=True, trust_remote_code=trust_remote_code,
                                                      **dtype)
    except SafetensorError as e:
        raise InputError(f"cannot load a model from {weights}: a weights file is damaged or incomplete "
                         f"({str(e).splitlines()[0]})" + ("; export it again" if complete else "")) from None
    except (OSError, ValueError, KeyError) as e:
        raise load_refused(weights, e, f"cannot load a model from {weights}") from None
    except pickle.UnpicklingError:  # torch.load's weights_only refused a pickle that holds more than tensors
        raise InputError(f"cannot load a model from {weights}: its weights are a pickle that holds more than "
                         "tensors, which could run code when loaded; save the model as safetensors where it came "
                         "from (save_pretrained does by default)") from None
    # from_pretrained fills missing weights with random ones and only warns: a trained model is refused.
    incomplete = info["missing_keys"] or info["mismatched_keys"]
    if complete and incomplete:
        raise InputError(f"{weights}: weights missing or of the wrong shape for its config: "
                         f"{', '.join(sorted(map(str, incomplete))[:3])}")
    return model


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    # Non-reentrant: gradients reach LoRA's adapters through a frozen embedding without
    # `enable_input_require_grads`. transformers 5 renamed the method (the old name warns).
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    try:
        enable({"use_reentrant": False})
    except ValueError as e:
        raise InputError(f"--gradient_checkpointing: {str(e).splitlines()[0]}") from None


def lora_settings(config) -> Optional[dict]:
    """apply_lora's keywords from a training config (a TrainConfig, or the dict a checkpoint keeps); None
    without LoRA."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key)
    if not get("lora"):
        return None
    return dict(r=get("lora_r"), alpha=get("lora_alpha"), dropout=get("lora_dropout"),
                target_modules=get("lora_target_modules"))


def load_weights(model, state_dict: dict, source: str) -> None:
    """Load a full state dict, refusing missing, extra or misshapen tensors (a random weight would pass silently)."""
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    consume_prefix_in_state_dict_if_present(state_dict, "module.")  # saved while wrapped by DDP
    try:
        result = model.load_state_dict(state_dict, strict=False)
    except RuntimeError as e:  # shapes that do not fit the config
        raise InputError(f"the weights in {source} do not fit its config: {' '.join(str(e).split())[:300]}") from None
    if result.missing_keys or result.unexpected_keys:
        raise InputError(f"the weights in {source} do not fit its config: {len(result.missing_keys)} tensor(s) "
                         f"missing {result.missing_keys[:3]}, {len(result.unexpected_keys)} unexpected "
                         f"{result.unexpected_keys[:3]}")


@contextmanager
def load_report_as_one_line(model: str):
    """transformers' LOAD REPORT (a table of the weights the checkpoint lacks or has in excess, logged when a
    pretrained backbone gets its new classification head) as one line from rank 0; the table with
    TEXTCLF_VERBOSE=1. A head that is new is what fine-tuning expects: nothing for the user to act on."""
    reports = []

    def keep(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" not in record.getMessage():
            return True
        reports.append(record.getMessage())
        return False

    source = logging.getLogger("transformers.modeling_utils")
    if not verbose():
        source.addFilter(keep)
    try:
        yield
    finally:
        source.removeFilter(keep)
    if reports:
        rows = re.findall(r"^(\S+)\s*\|\s*(MISSING|MISMATCH|UNEXPECTED)", reports[0], re.MULTILINE)
        new = sorted({key.rsplit(".", 1)[0] for key, status in rows if status != "UNEXPECTED"})
        unused = sum(status == "UNEXPECTED" for _, status in rows)
        say(f"note: {model}: new {', '.join(new) or 'weights'}, trained from random weights (the classification "
            f"head)" + (f"; {unused} of its weights unused (its pretraining head)" if unused else "")
            + "; TEXTCLF_VERBOSE=1 shows transformers' load report")


def layer_classes(model: PreTrainedModel) -> list[str]:
    """The classes of the model's repeated layers, which FSDP shards one by one: its family's
    `_no_split_modules` less those holding the input embeddings (embedding_holders), or, for families that
    declare none, the classes transformers marks as layers (GradientCheckpointingLayer)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    declared = getattr(model, "_no_split_modules", None)
    if declared:
        return sorted(set(declared) - embedding_holders(model))
    return sorted({type(m).__name__ for m in model.modules() if isinstance(m, GradientCheckpointingLayer)})


def embedding_holders(model: PreTrainedModel) -> set[str]:
    """The classes below the model that hold its input embeddings. accelerate shards those embeddings as a
    group of their own; a wrapped class that holds them (BERT's BertEmbeddings, which BERT declares in
    `_no_split_modules`) would shard them first, and FSDP2 refuses to shard a sharded parameter again."""
    try:
        embeddings = model.get_input_embeddings()
    except NotImplementedError:  # a custom model that names none: accelerate has none to shard apart
        return set()
    return {type(m).__name__ for m in list(model.modules())[1:] if any(sub is embeddings for sub in m.modules())}


def apply_lora(model: PreTrainedModel, r: int, alpha: int, dropout: float, target_modules=None):
    """Wrap `model` for LoRA: adapters on `target_modules`, the classification head trained in full.

    Without target modules, peft picks its default for the model type (query and value for BERT).
    The head is every top-level module outside the pretrained backbone (BERT's `classifier`,
    DistilBERT's `pre_classifier` and `classifier`, ...): it starts untrained, so it must learn.
    """
    from peft import LoraConfig, TaskType, get_peft_model

    head = [name for name, module in model.named_children()
            if name != model.base_model_prefix and any(True for _ in module.parameters())]
    # peft's sequence-classification task adds `classifier` and `score` by itself.
    extra_head = [name for name in head if name not in ("classifier", "score")]
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=target_modules, modules_to_save=extra_head or None)
    try:
        with warnings.catch_warnings():
            if not verbose():  # peft reads transformers' deprecated `is_gradient_checkpointing`: not the user's to fix
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated",
                                        category=FutureWarning)
            return get_peft_model(model, config)
    except ValueError as e:  # target modules that the model does not have, or a model type peft does not know
        raise InputError(f"cannot apply LoRA to {model.config.model_type}: {str(e).splitlines()[0]} "
                         "(choose modules with --lora_target_modules)") from None


def parameter_groups(model: PreTrainedModel, weight_decay: float) -> list[dict]:
    """AdamW's groups: weight decay on the weights, none on biases and normalisation layers; only the groups
    that hold a trainable parameter (LoRA of a decoder trains no bias or norm).

    An empty group must not reach the optimizer: DeepSpeed's ZeRO optimizers drop it while the scheduler,
    built on the torch optimizer, keeps a learning rate for it, and its first step fails.
    """
    from transformers.trainer_pt_utils import get_parameter_names

    # The Trainer's rule (its get_decay_parameter_names): LayerNorm by type; bias and any norm by name.
    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], NO_DECAY_NAME_PATTERNS))
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in trainable if name in decay], "weight_decay": weight_decay},
              {"params": [p for name, p in trainable if name not in decay], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def parameter_counts(model: PreTrainedModel) -> dict[str, int]:
    """All parameters, the trainable ones, and those in embedding tables (full sizes under ZeRO-3 too)."""
    def numel(p):
        return getattr(p, "ds_numel", p.numel())  # a ZeRO-3 partition keeps its full size here

    return {"params": sum(numel(p) for p in model.parameters()),
            "trainable": sum(numel(p) for p in model.parameters() if p.requires_grad),
            "embedding": sum(numel(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding))}


def compile_blocks(model: torch.nn.Module, **compile_kwargs) -> int:
    """Compile each of the model's repeated blocks (the classes of layer_classes) in place, with
    `nn.Module.compile`: the modules, their names and state_dict keys stay what they were. Returns how many.

    Only the blocks, not the modules around them (accelerate's regional compilation compiles those too): compiled,
    an embedding's backward adds its rows' gradients with atomic adds over threads, in an order that changes from
    run to run, which a bitwise resume cannot have; and the blocks are where the time goes.
    """
    classes = set(layer_classes(model))
    blocks = [module for module in model.modules() if type(module).__name__ in classes]
    for block in blocks:
        block.compile(**compile_kwargs)
    return len(blocks)
