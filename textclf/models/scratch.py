"""The offline default: a small BERT built from a config (scratch-tiny, -mini, -small, -medium, -base), and its
tokenizer, learnt from the training texts and cached by what it was learnt from.
"""

import json
import os
import shutil
from typing import Optional

from transformers import (
    BertConfig,
    BertTokenizerFast,
)

from textclf.errors import InputError
from textclf.files import sha256

# Sizes of Google's BERT miniatures (Turc et al., 2019) and BERT-base.
SCRATCH_SIZES = {
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2),
    "mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4),
    "small": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8),
    "medium": dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8),
    "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12),
}

SCRATCH_VOCAB_SIZE = 8000

# In a learnt tokenizer's folder: the sha256 of each of its files, as learnt.
LEARNT_FILES = "learnt_files.json"


def scratch_size(model: str):
    """'scratch-mini' -> 'mini'; None for a hub id or folder."""
    if not model.startswith("scratch-"):
        return None
    size = model.removeprefix("scratch-")
    if size not in SCRATCH_SIZES:
        raise InputError(f"unknown model size '{model}' (expected scratch-{{{','.join(SCRATCH_SIZES)}}})")
    return size


def scratch_tokenizer_folder(cache_dir: str, texts_key: str) -> str:
    return os.path.join(os.path.expanduser(cache_dir), f"tokenizer-{texts_key}-{SCRATCH_VOCAB_SIZE}")


def load_learnt_tokenizer(folder: str, max_length: int):
    """The tokenizer learnt into `folder`, refused in one line when its files are not those it was learnt with, or
    when its record of them (LEARNT_FILES) is gone: a damaged cache would otherwise fail in the tokenizers library,
    or load as another vocabulary without a word."""
    damage = learnt_files_damage(folder)
    if not damage:
        try:
            return BertTokenizerFast.from_pretrained(folder, model_max_length=max_length)
        except (OSError, ValueError) as e:
            damage = first_line(e)
    raise InputError(f"the tokenizer cached in {folder} is damaged ({damage}); delete that folder, and the next run "
                     "learns one again from the data")


def learnt_files_damage(folder: str) -> Optional[str]:
    """How the files in a learnt tokenizer's folder differ from its record of them (LEARNT_FILES), or None. Without
    the record nothing can tell its vocabulary from another (ids swapped load as well), so a folder without one,
    cached before the files were recorded or with the record deleted, is damaged too; so is a file the record does
    not name, which loading would read all the same."""
    try:
        with open(os.path.join(folder, LEARNT_FILES), encoding="utf-8") as f:
            recorded = json.load(f)
        if not (isinstance(recorded, dict) and recorded and all(isinstance(v, str) for v in recorded.values())):
            return f"{LEARNT_FILES} is not the record of its files"
        changed = [name for name, digest in recorded.items() if sha256(os.path.join(folder, name)) != digest]
    except FileNotFoundError as e:
        if os.path.basename(e.filename or "") == LEARNT_FILES:
            return f"{LEARNT_FILES}, the record of its files, is missing"
        return first_line(e)
    except (OSError, ValueError) as e:  # a file unreadable; JSON that does not parse
        return first_line(e)
    unrecorded = sorted(set(os.listdir(folder)) - set(recorded) - {LEARNT_FILES})
    problems = [f"{', '.join(changed)} changed since it was learnt"] if changed else []
    if unrecorded:
        problems.append(f"{', '.join(unrecorded)} not among the files it was learnt with")
    return "; ".join(problems) or None


def first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def load_saved_tokenizer(folder: str, max_length: int):
    """A scratch model's tokenizer as train.py saves it in a checkpoint, loaded as a learnt one is (the caller has
    checked its files against the checkpoint's record)."""
    try:
        return BertTokenizerFast.from_pretrained(folder, model_max_length=max_length)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot load the tokenizer saved in {folder}: {first_line(e)}") from None


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
    return BertConfig(vocab_size=vocab_size, intermediate_size=4 * SCRATCH_SIZES[size]["hidden_size"],
                      max_position_embeddings=max(512, max_length), **SCRATCH_SIZES[size], **extra)
