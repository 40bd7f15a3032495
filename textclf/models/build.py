"""Every model is built by make_model: to train, to read back, the check's, the export's copy, from a scratch config
(the offline default: a small BERT, scratch-tiny to scratch-base) or pretrained weights, with LoRA's adapters where
asked; AdamW's parameter groups and the counts a run reports. A pretrained model's config is checked before the data
is read (custom code refused unless trusted), a body that does not fit its config is refused, and its new head is
said in one line.
"""

import logging
import pickle
import re
from contextlib import contextmanager, nullcontext
from typing import Optional

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    BertConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
from transformers.models.auto.tokenization_auto import get_tokenizer_config

from textclf.errors import InputError, say, verbose

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

# The class of every model here (make_model), and the configs it has a class for: a fork that wants another kind
# of head changes these two lines alone.
MODEL_CLASS = AutoModelForSequenceClassification

MODEL_CLASS_MAPPING = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING


def scratch_size(model: str):
    """'scratch-mini' -> 'mini'; None for a hub id or folder."""
    if not model.startswith("scratch-"):
        return None
    size = model.removeprefix("scratch-")
    if size not in SCRATCH_SIZES:
        raise InputError(f"unknown model size '{model}' (expected scratch-{{{','.join(SCRATCH_SIZES)}}})")
    return size


def scratch_config(size: str, vocab_size: int, max_length: int, **extra) -> BertConfig:
    return BertConfig(vocab_size=vocab_size, intermediate_size=4 * SCRATCH_SIZES[size]["hidden_size"],
                      max_position_embeddings=max(512, max_length), **SCRATCH_SIZES[size], **extra)


def model_config(model: str, max_length: int, trust_remote_code: bool = False) -> Optional[PretrainedConfig]:
    """A pretrained model's config, checked before any weight is read (read_config); None for a
    scratch model (scratch_config)."""
    if scratch_size(model):
        return None
    return read_config(model, max_length, trust_remote_code)


def training_config(model: str, tokenizer, head: dict, max_length: int, *, config: Optional[PretrainedConfig] = None,
                    trust_remote_code: bool = False) -> PretrainedConfig:
    """The config of the model to train, with the task's head (Task.head_config: label names, and the
    `problem_type` that picks the model's loss) and the tokenizer's pad token: a scratch BERT's, or `model`'s own
    (`config`, if the caller has read it with model_config)."""
    size = scratch_size(model)
    if size:
        return scratch_config(size, len(tokenizer), max_length, pad_token_id=tokenizer.pad_token_id, **head)

    return with_head(config or model_config(model, max_length, trust_remote_code), head, tokenizer.pad_token_id)


def make_model(config: PretrainedConfig, weights=None, *, lora=None, complete: bool = False,
               source: str = "the trained model", torch_dtype: Optional[str] = None,
               gradient_checkpointing: bool = False, trust_remote_code: bool = False) -> PreTrainedModel:
    """Every model of the project, as a MODEL_CLASS of `config`.

    `weights`: None for fresh random ones (none at all under `torch.device("meta")`, the check's); a hub id or
    folder for `from_pretrained` (a backbone to fine-tune, or with `complete` a model folder, which must hold every
    weight); or a full state dict (a step_<N> checkpoint's, an export's copy), which must fit exactly, LoRA's
    adapters included; `source` names it in the refusal.
    `lora`: None; apply_lora's keywords for new adapters; or a folder of trained ones (whose base `weights` then
    holds). `torch_dtype`: a torch dtype's name, "auto" for the checkpoint's, or None for the libraries' defaults
    (from_pretrained: float32; from_config: the config's dtype, the trained model's).
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
        from .lora import apply_lora

        model = apply_lora(model, **lora)
    if isinstance(weights, dict):
        load_weights(model, weights, source)
    if isinstance(lora, str):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, lora)
    return model


def from_pretrained(weights: str, config: PretrainedConfig, complete: bool, dtype: dict,
                    trust_remote_code: bool) -> PreTrainedModel:
    """make_model's `from_pretrained`: a backbone, whose new head is said in one line and whose body must fit its
    config, or with `complete` a model folder, which must hold every weight (from_pretrained would fill what is
    missing or misshapen with random ones, and only warn)."""
    if complete:
        report = nullcontext()
    else:
        report = load_report_as_one_line(weights)
    try:
        with report:
            model, info = MODEL_CLASS.from_pretrained(weights, config=config, ignore_mismatched_sizes=True,
                                                      output_loading_info=True, trust_remote_code=trust_remote_code,
                                                      **dtype)
            if not complete:  # before the note on the new head, which would name them as part of it
                refuse_misshapen_body(weights, model, info["mismatched_keys"])
    except SafetensorError as e:
        raise InputError(f"cannot load a model from {weights}: a weights file is damaged or incomplete "
                         f"({str(e).splitlines()[0]})" + ("; export it again" if complete else "")) from None
    except (OSError, ValueError, KeyError) as e:
        raise load_refused(weights, e, f"cannot load a model from {weights}") from None
    except pickle.UnpicklingError:  # torch.load's weights_only refused a pickle that holds more than tensors
        raise InputError(f"cannot load a model from {weights}: its weights are a pickle that holds more than "
                         "tensors, which could run code when loaded; save the model as safetensors where it came "
                         "from (save_pretrained does by default)") from None
    incomplete = info["missing_keys"] or info["mismatched_keys"]
    if complete and incomplete:
        raise InputError(f"{weights}: weights missing or of the wrong shape for its config: "
                         f"{', '.join(sorted(map(str, incomplete))[:3])}")
    return model


def lora_settings(config) -> Optional[dict]:
    """apply_lora's keywords from a training config (a TrainConfig, or a checkpoint's dict); None without LoRA."""
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


def layer_classes(model: PreTrainedModel) -> list[str]:
    """The classes of the model's repeated layers, which FSDP shards one by one: its `_no_split_modules` less the
    embedding_holders, or where a family declares none, the classes transformers marks GradientCheckpointingLayer."""
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


def parameter_groups(model: PreTrainedModel, weight_decay: float) -> list[dict]:
    """AdamW's groups: weight decay on the weights, none on biases and normalisation layers (the Trainer's rule,
    its get_decay_parameter_names: LayerNorm by type, bias and any norm by name); only groups that hold a
    trainable parameter: DeepSpeed's ZeRO optimizers drop an empty one while the scheduler keeps a learning rate
    for it, and its first step fails (LoRA of a decoder trains no bias or norm)."""
    from transformers.trainer_pt_utils import get_parameter_names

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


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    # Non-reentrant: gradients reach LoRA's adapters through a frozen embedding without
    # `enable_input_require_grads`. transformers 5 renamed the method (the old name warns).
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    try:
        enable({"use_reentrant": False})
    except ValueError as e:
        raise InputError(f"--gradient_checkpointing: {str(e).splitlines()[0]}") from None


def in_units(count: int) -> str:
    """A count of parameters in the unit that fits it, to three digits: 38,144 as 38.1k, 5,410,000 as 5.41M."""
    rounded = float(f"{count:.3g}")  # 999,600 is 1.00M, not 1e+03k
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if rounded >= size:
            return f"{rounded / size:.3g}{unit}"
    return str(count)


def needs_remote_code(model: str) -> InputError:
    return InputError(f"'{model}' needs custom code to load (its config's auto_map names Python files it ships); "
                      "pass --trust_remote_code if you trust that code")


def refuse_custom_code(source: str, auto_map: Optional[dict], trust_remote_code: bool) -> None:
    """Where transformers knows the type (`bert`) it would silently load its own class in place of the code an
    auto_map names: that code needs trust_remote_code all the same."""
    if auto_map and not trust_remote_code:
        raise needs_remote_code(source)


def load_refused(model: str, error: Exception, problem: str) -> InputError:
    """What transformers raised loading `model` as one line: its own code refused, or `problem` and the cause."""
    if "trust_remote_code" in str(error):
        return needs_remote_code(model)
    return InputError(f"{problem}: {(str(error).splitlines() or [type(error).__name__])[0]}")


def read_config(model: str, max_length: int, trust_remote_code: bool = False) -> PretrainedConfig:
    """`model`'s config, read before any weight and checked: its code is transformers' own unless trusted, it has
    a sequence-classification class, and positions for `max_length` tokens."""
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


def with_head(config: PretrainedConfig, head: dict, pad_token_id: int) -> PretrainedConfig:
    """`config` to train: the task's head, the pad token (decoder heads look for it to find each text's last
    token), no key/value cache (a classifier never generates)."""
    for key, value in head.items():
        setattr(config, key, value)
    config.pad_token_id = pad_token_id
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config


def refuse_misshapen_body(source: str, model, mismatched) -> None:
    """Only a new classification head may be trained from random weights: a weight of the model's body (below its
    base model) saved in another shape than its config says (transformers' `mismatched_keys`: key, saved shape,
    the config's shape) is a folder whose config and weights disagree, refused in one line. A head of another
    shape (the task has other labels than the folder's) is new, as fine-tuning expects."""
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or model.base_model is model:  # no body apart from a head to tell
        return
    body = sorted((key, tuple(saved), tuple(expected)) for key, saved, expected in mismatched
                  if key.startswith(f"{prefix}."))
    if body:
        key, saved, expected = body[0]
        others = [name for name, *_ in body[1:]]
        also = f" (and {len(others)} more: {', '.join(others[:3])}{', ...' if len(others) > 3 else ''})" if others \
            else ""
        raise InputError(f"cannot fine-tune {source}: its saved {key} is {list(saved)} where its config makes it "
                         f"{list(expected)}{also}; only a new classification head is trained from random weights, "
                         "never the model's body: save the config and the weights from one model "
                         "(save_pretrained), or choose another --model")


@contextmanager
def load_report_as_one_line(model: str):
    """transformers' LOAD REPORT (a table of the weights a backbone lacks or has in excess for its new head) as one
    line from rank 0, the table with TEXTCLF_VERBOSE=1: a new head is what fine-tuning expects, nothing to act on."""
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
