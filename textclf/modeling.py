"""Models: the offline default (a BERT built from config), anything `from_pretrained` loads, LoRA."""

import os

from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

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


def build_model(model: str, tokenizer, label_names: list[str], max_length: int) -> PreTrainedModel:
    """A sequence classifier whose config carries the label names of the data."""
    labels = dict(num_labels=len(label_names), id2label=dict(enumerate(label_names)),
                  label2id={name: i for i, name in enumerate(label_names)})
    size = scratch_size(model)
    if size:
        config = BertConfig(vocab_size=len(tokenizer), intermediate_size=4 * SCRATCH_SIZES[size]["hidden_size"],
                            max_position_embeddings=max(512, max_length), pad_token_id=tokenizer.pad_token_id,
                            **SCRATCH_SIZES[size], **labels)
        return BertForSequenceClassification(config)
    try:
        return AutoModelForSequenceClassification.from_pretrained(model, ignore_mismatched_sizes=True, **labels)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot load a model from '{model}': {str(e).splitlines()[0]}") from None
