"""A pretrained model (--model a hub id or folder): its config checked before the data is read (custom code refused
unless trusted), its tokenizer, and its new head said in one line.
"""

import logging
import re
from contextlib import contextmanager
from typing import Optional

from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    PretrainedConfig,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
from transformers.models.auto.tokenization_auto import get_tokenizer_config

from textclf.errors import InputError, say, verbose

# The class of every model here (make_model), and the configs it has a class for: a fork that wants another kind
# of head changes these two lines alone.
MODEL_CLASS = AutoModelForSequenceClassification

MODEL_CLASS_MAPPING = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING


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
