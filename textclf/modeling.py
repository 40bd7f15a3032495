"""Models: the offline default (a BERT built from config), anything `from_pretrained` loads, LoRA,
and trained models read back from an exported folder or a step_<N> checkpoint."""

import glob
import os
import tempfile

import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .checkpoint import POSITION, STEP_DIR, read_position
from .config import InputError

# Sizes of Google's BERT miniatures (Turc et al., 2019) and BERT-base.
SCRATCH_SIZES = {
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2),
    "mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4),
    "small": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8),
    "medium": dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8),
    "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12),
}
SCRATCH_VOCAB_SIZE = 8000


def scratch_size(model: str):
    """'scratch-mini' -> 'mini'; None for a hub id or folder."""
    if not model.startswith("scratch-"):
        return None
    size = model.removeprefix("scratch-")
    if size not in SCRATCH_SIZES:
        raise InputError(f"unknown model size '{model}' (expected scratch-{{{','.join(SCRATCH_SIZES)}}})")
    return size


def get_tokenizer(model: str, texts, cache_dir: str, data_fingerprint: str, max_length: int):
    """The model's tokenizer; for a scratch model, one learnt from the training texts and cached.

    Call it on the local main process first: the others then find the cached one.
    """
    if not scratch_size(model):
        try:
            return AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError) as e:
            raise InputError(f"cannot load a tokenizer from '{model}': {str(e).splitlines()[0]}") from None
    folder = os.path.join(os.path.expanduser(cache_dir), f"tokenizer-{data_fingerprint}-{SCRATCH_VOCAB_SIZE}")
    if not os.path.isdir(folder):
        train_tokenizer(texts, folder)
    return BertTokenizerFast.from_pretrained(folder, model_max_length=max_length)


def train_tokenizer(texts, folder: str) -> None:
    """A BERT WordPiece vocabulary learnt from the texts (every CJK character its own token)."""
    from tokenizers import BertWordPieceTokenizer

    wordpiece = BertWordPieceTokenizer(handle_chinese_chars=True, lowercase=True)
    wordpiece.train_from_iterator(texts, vocab_size=SCRATCH_VOCAB_SIZE, min_frequency=2, show_progress=False)
    tmp = f"{folder}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    wordpiece.save_model(tmp)
    BertTokenizerFast(os.path.join(tmp, "vocab.txt")).save_pretrained(tmp)
    os.replace(tmp, folder)


def scratch_config(size: str, vocab_size: int, max_length: int, **extra) -> BertConfig:
    """The config of a `scratch-<size>` BERT."""
    return BertConfig(vocab_size=vocab_size, intermediate_size=4 * SCRATCH_SIZES[size]["hidden_size"],
                      max_position_embeddings=max(512, max_length), **SCRATCH_SIZES[size], **extra)


def build_model(model: str, tokenizer, label_names: list[str], max_length: int) -> PreTrainedModel:
    """A sequence classifier whose config carries the label names of the data."""
    labels = dict(num_labels=len(label_names), id2label=dict(enumerate(label_names)),
                  label2id={name: i for i, name in enumerate(label_names)})
    size = scratch_size(model)
    if size:
        config = scratch_config(size, len(tokenizer), max_length, pad_token_id=tokenizer.pad_token_id, **labels)
        return BertForSequenceClassification(config)
    try:
        return AutoModelForSequenceClassification.from_pretrained(model, ignore_mismatched_sizes=True, **labels)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot load a model from '{model}': {str(e).splitlines()[0]}") from None


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
        return get_peft_model(model, config)
    except ValueError as e:  # target modules that the model does not have, or a model type peft does not know
        raise InputError(f"cannot apply LoRA to {model.config.model_type}: {str(e).splitlines()[0]} "
                         "(choose modules with --lora_target_modules)") from None


# --- Trained models, read back --------------------------------------------------------------------
# An exported folder is a Hugging Face model folder. With LoRA it holds the adapter (and the trained
# head) at the top, where peft and `pipeline` look for it, and the base model it applies to in base/:
# a scratch base exists nowhere else, and the folder must load offline.
LORA_BASE = "base"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def load_trained(path: str, allow_pickle: bool = False):
    """(model, tokenizer) from an exported model folder or a step_<N> checkpoint; the model in eval mode.

    `allow_pickle` lets a DeepSpeed checkpoint load: DeepSpeed's files are full pickles, which can
    run code stored in them.
    """
    if not os.path.isdir(path):
        raise InputError(f"model not found: {path} (expected a model folder or a step_<N> checkpoint)")
    if os.path.isfile(os.path.join(path, POSITION)) or STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        model, tokenizer = _load_checkpoint(path, allow_pickle)
    elif glob.glob(os.path.join(path, "*.json")) or weight_files(path):
        model, tokenizer = _load_folder(path)
    else:
        raise InputError(f"{path} is neither a model folder (config.json and weights, as export writes) nor a "
                         f"step_<N> checkpoint ({POSITION}, as train.py writes)")
    return model.eval(), tokenizer


def weight_files(folder: str) -> list[str]:
    """The safetensors files of a model folder (export writes nothing else)."""
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def require_model_files(folder: str) -> None:
    """A model folder needs its config and its weights; say which one is missing."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise InputError(f"{folder} is not a complete model folder: it has no config.json")
    if not weight_files(folder) and not glob.glob(os.path.join(folder, "pytorch_model*.bin")):
        raise InputError(f"{folder} is not a complete model folder: it has no weights (model.safetensors)")


def _load_folder(folder: str):
    from peft import PeftModel

    lora = os.path.isfile(os.path.join(folder, ADAPTER_CONFIG))
    base_folder = os.path.join(folder, LORA_BASE) if lora else folder
    require_model_files(base_folder)
    if lora and not os.path.isfile(os.path.join(folder, ADAPTER_WEIGHTS)):
        raise InputError(f"{folder} is not a complete LoRA model folder: it has no {ADAPTER_WEIGHTS}")
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(base_folder, output_loading_info=True)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot load a model from {base_folder}: {str(e).splitlines()[0]}") from None
    # from_pretrained fills missing weights with random ones and only warns: refuse instead.
    incomplete = info["missing_keys"] or info["mismatched_keys"]
    if incomplete:
        raise InputError(f"{base_folder}: weights missing or of the wrong shape for its config: "
                         f"{', '.join(sorted(map(str, incomplete))[:3])}")
    if lora:
        model = PeftModel.from_pretrained(model, folder)
    return model, _load_tokenizer(folder)


def _load_checkpoint(checkpoint: str, allow_pickle: bool):
    run = read_position(checkpoint).get("config") or {}
    try:
        config = AutoConfig.from_pretrained(checkpoint)
    except (OSError, ValueError):
        raise InputError(f"{checkpoint} is not a complete checkpoint: it has no readable config.json") from None
    model = AutoModelForSequenceClassification.from_config(config)
    if run.get("lora"):  # the run's own settings rebuild the same adapters
        model = apply_lora(model, run["lora_r"], run["lora_alpha"], run["lora_dropout"], run["lora_target_modules"])
    load_weights(model, checkpoint_weights(checkpoint, allow_pickle), checkpoint)
    return model, _load_tokenizer(os.path.join(checkpoint, "tokenizer"))


def checkpoint_weights(checkpoint: str, allow_pickle: bool) -> dict:
    """The full weights in a step_<N> checkpoint, whichever strategy wrote it."""

    def needs_pickle(why: str) -> None:
        if not allow_pickle:
            raise InputError(f"loading {checkpoint} takes full pickle ({why}), which can run code stored in its "
                             "files; pass --allow_pickle if you trust this checkpoint")

    path = os.path.join(checkpoint, "model.safetensors")
    if os.path.isfile(path):  # one process or DDP: accelerate's save_state writes the whole model
        return load_file(path)
    if os.path.isfile(os.path.join(checkpoint, "latest")):  # DeepSpeed: shards per rank, under the tag in `latest`
        needs_pickle("DeepSpeed's shards are pickles")
        # DeepSpeed's own consolidation (what the zero_to_fp32.py beside the shards runs): the fp32
        # master weights of ZeRO-1/2/3, frozen parameters included.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(checkpoint)
    path = os.path.join(checkpoint, "pytorch_model_fsdp_0")
    if os.path.isdir(path):  # FSDP with SHARDED_STATE_DICT: a torch.distributed.checkpoint folder
        needs_pickle("the metadata of FSDP's distributed checkpoint is a pickle")
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:  # torch's own consolidation, on one process
            dcp_to_torch_save(path, os.path.join(tmp, "model.pt"))
            return torch.load(os.path.join(tmp, "model.pt"), weights_only=True)["model"]
    path = os.path.join(checkpoint, "pytorch_model_fsdp.bin")
    if os.path.isfile(path):  # FSDP with FULL_STATE_DICT: plain tensors, which torch loads without pickle
        return torch.load(path, map_location="cpu", weights_only=True)
    raise InputError(f"{checkpoint} is not a complete checkpoint: it holds no model weights (model.safetensors, "
                     "DeepSpeed's shards and their `latest` file, or FSDP's pytorch_model_fsdp*)")


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


def _load_tokenizer(folder: str):
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:
        raise InputError(f"cannot load the tokenizer saved in {folder}: {str(e).splitlines()[0]}") from None
