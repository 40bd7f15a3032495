"""A run's tokenizer, made, cached, verified and read back here: a pretrained model's own (padding on the right, with a
pad token); for a scratch model one learnt from the training texts (a sample of them, drawn with the seed), cached by
what it was learnt from with the sha256 of each of its files and trusted only as learnt; a resume's, the one its
checkpoint saved; an exported folder's.
"""

import json
import os
import random
import shutil
import time
from typing import Iterator, Optional

from datasets import Dataset
from transformers import AutoTokenizer, BertTokenizerFast, PreTrainedTokenizerBase

from textclf.data import text_columns
from textclf.errors import InputError, say
from textclf.files import sha256

from .build import SCRATCH_VOCAB_SIZE, load_refused, refuse_custom_code, scratch_size

# In a learnt tokenizer's folder: the sha256 of each of its files, as learnt.
LEARNT_FILES = "learnt_files.json"


def get_tokenizer(model: str, texts, cache_dir: str, texts_key: str, max_length: int,
                  trust_remote_code: bool = False, saved_in: Optional[str] = None):
    """The model's tokenizer, ready to pad batches; for a scratch model, one learnt from `texts` (strings or
    batches of them) and cached under `texts_key` (sample_key). Call it on the local main process first:
    the others then find the cached one.

    `saved_in`: a resume's, the folder where its checkpoint saved the tokenizer it was trained with, its files
    already checked against the checkpoint's record; taken whatever the cache holds, since a tokenizer learnt
    again from the same texts is not always the same vocabulary."""
    if saved_in is not None:
        tokenizer = load_saved_tokenizer(saved_in, max_length) if scratch_size(model) else \
            load_pretrained_tokenizer(saved_in, trust_remote_code)
        say(f"data: the tokenizer of {len(tokenizer):,} tokens that the checkpoint was trained with, from {saved_in}")
        return tokenizer
    if not scratch_size(model):
        return load_pretrained_tokenizer(model, trust_remote_code)
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


def text_sample(table: Dataset, size: int, seed: int) -> Iterator[list[str]]:
    """Batches of the texts a scratch tokenizer learns from: both texts of `size` examples drawn with `seed`
    (every example when `size` is 0 or the table is smaller), read a batch at a time, never all at once."""
    if 0 < size < len(table):
        table = table.select(sorted(random.Random(seed).sample(range(len(table)), size)))
    for batch in table.select_columns(text_columns(table)).iter(batch_size=1000):
        yield from batch.values()


def sample_key(data_fingerprint: str, rows: int, size: int, seed: int) -> str:
    """What names the texts that text_sample draws from `rows` examples with this fingerprint, for caches."""
    return f"{data_fingerprint}-all" if not 0 < size < rows else f"{data_fingerprint}-sample{size}-seed{seed}"


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


def load_pretrained_tokenizer(model: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """`model`'s tokenizer, padding on the right, with a pad token: the eos token where the family ships none
    (Llama, Qwen2 and GPT-2), as their own classification examples set it.

    Right, not the left that some families (Llama's) ship for generation: decoder heads classify from the
    rightmost token that is not padding and count positions from the first, so every text keeps the
    positions it has alone.
    """
    try:
        # padding_side as a loading argument, not set afterwards: only then does save_pretrained keep it.
        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code, padding_side="right")
    except (OSError, ValueError) as e:
        raise load_refused(model, e, f"cannot load a tokenizer from '{model}'") from None
    refuse_custom_code(model, tokenizer.init_kwargs.get("auto_map"), trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise InputError(f"the tokenizer of '{model}' has neither a pad token nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_folder_tokenizer(folder: str, trust_remote_code: bool = False):
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise load_refused(folder, e, f"cannot load the tokenizer saved in {folder}") from None
    refuse_custom_code(folder, tokenizer.init_kwargs.get("auto_map"), trust_remote_code)
    return tokenizer
