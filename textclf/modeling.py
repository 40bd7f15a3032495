"""Models to train: the offline default (a BERT built from config and a tokenizer learnt from the
texts), anything `from_pretrained` loads, LoRA. Reading trained models back is `loading.py`'s."""

import os
import shutil

from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .errors import InputError

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


def parameter_groups(model: PreTrainedModel, weight_decay: float) -> list[dict]:
    """AdamW's two groups: weight decay on the weights, none on biases and normalisation layers.

    The rule is the Trainer's own (LayerNorm by type; bias, LayerNorm, RMSNorm and `norm` by name);
    `get_decay_parameter_names` reads nothing of the Trainer it is a method of.
    """
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for name, p in trainable if name in decay], "weight_decay": weight_decay},
            {"params": [p for name, p in trainable if name not in decay], "weight_decay": 0.0}]


def parameter_counts(model: PreTrainedModel) -> dict[str, int]:
    """All parameters, the trainable ones, and those in embedding tables (full sizes under ZeRO-3 too)."""
    import torch

    def numel(p):
        return getattr(p, "ds_numel", p.numel())  # a ZeRO-3 partition keeps its full size here

    return {"params": sum(numel(p) for p in model.parameters()),
            "trainable": sum(numel(p) for p in model.parameters() if p.requires_grad),
            "embedding": sum(numel(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding))}
