"""The exported model folder: written at the end of a run (export_model), verified before it takes its place
(save_verified), read back (load_model_folder). A Hugging Face model folder: safetensors weights, a config with the
task (`problem_type`, id2label), the tokenizer, and TRAINING; a LoRA folder holds the base and the adapter.
"""

import contextlib
import glob
import os
from contextlib import contextmanager
from typing import Optional

import torch
from accelerate import Accelerator
from datasets import Dataset
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from tqdm.auto import tqdm
from transformers import AutoConfig

from textclf import files
from textclf.data import length_sorted_loader, tokenize
from textclf.errors import WRITE_ERRORS, InputError, write_failed
from textclf.files import write_json

from .build import load_refused, lora_settings, make_model, refuse_custom_code
from .tokenizer import load_folder_tokenizer

ADAPTER_CONFIG = "adapter_config.json"

ADAPTER_WEIGHTS = "adapter_model.safetensors"

# The config of the run that trained the model and its data fingerprint: the task and columns predict and report
# default to (a checkpoint's position.json holds the same).
TRAINING = "training.json"

# Texts of several lengths and scripts, so that padding and truncation are part of the check.
PROBE_TEXTS = [
    "这家店的菜很好吃，送餐也快，下次还会再点。",
    "太难吃了，等了两个小时，再也不会买了",
    "一般",
    "质量很差，客服态度也不好，等了一个星期才到货，包装还是破的，"
    "退货流程又麻烦，非常失望，不推荐大家购买。",
    "Great value, would buy again.",
    "物流快 👍",
    "ok",
    "书的内容不错，但是印刷有错别字。",
]


def export_model(accelerator: Accelerator, model, tokenizer, target: str, training: dict,
                 trust_remote_code: bool = False) -> str:
    """Export the model being trained, with `training` (the run's config and data fingerprint) in TRAINING.
    Collective: every rank calls it (ZeRO-3 gathers the shards).

    `accelerator.get_state_dict` gives full weights whatever the strategy (`unwrap_model(model).save_pretrained`
    would write empty tensors under ZeRO-3; `accelerator.save_model` writes no config.json). The main process
    saves a fresh CPU copy holding them, built as build_job built the model: under ZeRO-3 no rank holds the whole
    model to predict with, the verification compares the written folder's predictions with the copy's, and
    save_verified uses the copy up (LoRA unloaded in place).
    """
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        with transformers_without_zero3(accelerator):
            copy = make_model(accelerator.unwrap_model(model).config, state_dict,
                              lora=lora_settings(training["config"]), trust_remote_code=trust_remote_code)
            save_verified(copy.eval(), tokenizer, target, overwrite=True, training=training,
                          trust_remote_code=trust_remote_code)
    accelerator.wait_for_everyone()
    return target


@contextmanager
def transformers_without_zero3(accelerator: Accelerator):
    """Under ZeRO-3 transformers builds every model partitioned over all the ranks; the export's copy lives on the
    main process alone."""
    from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    if not is_deepspeed_zero3_enabled():
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()  # registers the run's config with transformers again


def save_verified(model, tokenizer, target: str, *, merge: bool = False, overwrite: bool = False,
                  training: Optional[dict] = None, trust_remote_code: bool = False) -> str:
    """Write `model` (plain or LoRA, full weights, on CPU), its tokenizer and `training` (TRAINING) to `target`,
    verified: written beside it, the folder takes its place once every tensor is non-empty, it loads as predict
    and report load models, and its logits on PROBE_TEXTS equal the model's. `model` is used up: LoRA is merged
    or unloaded in place."""
    from peft import PeftModel

    refuse_existing(target, overwrite)
    expected = predict_logits(model, tokenizer, PROBE_TEXTS)
    parent, name = os.path.split(os.path.abspath(target))
    tmp = os.path.join(parent, f".{name}.incomplete")
    try:
        try:
            files.new_folder(tmp)  # what an export that was killed left is removed, a link is not followed
            if isinstance(model, PeftModel) and not merge:
                from .lora import save_adapter

                save_adapter(model, tmp, os.path.abspath(target))
            else:
                if isinstance(model, PeftModel):
                    model = model.merge_and_unload()  # W + BA: a plain model of the base architecture
                model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if training:
                write_json(os.path.join(tmp, TRAINING), training)
            files.give_usual_modes(tmp)  # safetensors writes its weights 0600, the rest of the folder is 0644
        except WRITE_ERRORS as e:
            raise write_failed("export the model to", target, e, "free space (or choose another place), then export "
                               "again: train.py --resume latest, or python -m textclf.export <step_N> <target>; "
                               "checkpoints are untouched") from None
        verify_weights(tmp)
        reloaded, reloaded_tokenizer = load_model_folder(tmp, trust_remote_code)
        actual = predict_logits(reloaded, reloaded_tokenizer, PROBE_TEXTS)
        # Merging changes rounding only: 1e-5 is far below any real difference in weights.
        if not torch.allclose(actual, expected, rtol=1e-4, atol=1e-5):
            raise InputError(f"export to {target} failed verification: the written model's logits differ from the "
                             f"trained model's by up to {(actual - expected).abs().max():.2e}")
        try:
            replace_folder(tmp, target)
        except OSError as e:
            raise write_failed("put the exported model in place at", target, e, "move the folder in the way "
                               "(or make it writable), then export again") from None
    finally:
        with contextlib.suppress(OSError):
            files.remove(tmp)  # already gone when it became the target
    return target


def refuse_existing(target: str, overwrite: bool) -> None:
    if os.path.exists(target) and not overwrite:
        raise InputError(f"{target} already exists; choose another target or pass --overwrite to replace it")


def replace_folder(new: str, target: str) -> None:
    """Put `new` at `target`; an old target is only deleted once the new one is in its place (a link at `target`
    is replaced, never followed)."""
    old = f"{new}.old"
    files.remove(old)
    if os.path.lexists(target):
        os.rename(target, old)
    os.rename(new, target)
    with contextlib.suppress(OSError):
        files.remove(old)


def verify_weights(folder: str) -> None:
    """Every tensor saved in the folder (LoRA adapter included) has a size: a ZeRO-3 model saved without
    gathering writes its parameters as empty placeholders."""
    files = weight_files(folder)
    if not files:
        raise InputError(f"{folder} has no safetensors weights")
    for path in files:
        with safe_open(path, framework="pt") as weights:
            for name in weights.keys():
                if 0 in weights.get_slice(name).get_shape():
                    raise InputError(f"{path}: tensor {name} is empty (a ZeRO-3 shard saved without gathering?)")


def load_model_folder(folder: str, trust_remote_code: bool = False):
    """(model, tokenizer) from a model folder (plain, or LoRA's base and adapter); the model in eval mode."""
    lora = os.path.isfile(os.path.join(folder, ADAPTER_CONFIG))
    require_model_files(folder)
    if lora and not os.path.isfile(os.path.join(folder, ADAPTER_WEIGHTS)):
        raise InputError(f"{folder} is not a complete LoRA model folder: it has no {ADAPTER_WEIGHTS}")
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise load_refused(folder, e, f"cannot load a model from {folder}") from None
    refuse_custom_code(folder, getattr(config, "auto_map", None), trust_remote_code)
    if lora:
        model = make_model(config, base_weights(folder), lora=folder, source=folder,
                           trust_remote_code=trust_remote_code)
    else:
        model = make_model(config, folder, complete=True, trust_remote_code=trust_remote_code)
    return model.eval(), load_folder_tokenizer(folder, trust_remote_code)


def weight_files(folder: str) -> list[str]:
    """The safetensors files of a model folder (export writes nothing else), the LoRA adapter's included."""
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def base_weight_files(folder: str) -> list[str]:
    return [path for path in weight_files(folder) if os.path.basename(path) != ADAPTER_WEIGHTS]


def base_weights(folder: str) -> dict:
    """A LoRA folder's base weights, without the adapter's: from_pretrained(folder) would add the adapter
    itself, and peft's PeftModel (which export merges) must add it instead."""
    try:
        return {name: tensor for path in base_weight_files(folder) for name, tensor in load_file(path).items()}
    except SafetensorError as e:
        raise InputError(f"cannot load a model from {folder}: a weights file is damaged or incomplete "
                         f"({str(e).splitlines()[0]}); export it again") from None


def require_model_files(folder: str) -> None:
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise InputError(f"{folder} is not a complete model folder: it has no config.json")
    if not base_weight_files(folder) and not glob.glob(os.path.join(folder, "pytorch_model*.bin")):
        raise InputError(f"{folder} is not a complete model folder: it has no weights (model.safetensors)")


def predict_logits(model, tokenizer, texts: list[str], pairs: Optional[list[str]] = None, *, batch_size: int = 64,
                   accelerator: Optional[Accelerator] = None, progress: bool = False) -> torch.Tensor:
    """Logits for `texts` (each with its pair from `pairs`), row i for text i, on one process or shared out among
    `accelerator`'s; every process gets them all (`gather_for_metrics` drops the rows accelerate repeats to give
    every process as many batches)."""
    max_length = min(tokenizer.model_max_length, getattr(model.config, "max_position_embeddings", float("inf")))
    columns = {"text": list(texts), **({"text_pair": list(pairs)} if pairs is not None else {})}
    table = tokenize(Dataset.from_dict({**columns, "index": list(range(len(texts)))}), tokenizer, max_length)
    loader = length_sorted_loader(table, tokenizer, batch_size)
    if accelerator is not None:
        loader = accelerator.prepare(loader)  # shards the batches and moves them to the device
        model.to(accelerator.device)
    device = next(model.parameters()).device
    logits = torch.empty(len(texts), model.config.num_labels)
    show = progress and len(loader) > 1 and (accelerator is None or accelerator.is_local_main_process)
    model.eval()
    with torch.no_grad():
        for batch in tqdm(loader, desc="predict", unit="batch", disable=not show):
            index = batch.pop("index")
            batch_logits = model(**batch.to(device)).logits.float()
            if accelerator is not None:
                index, batch_logits = accelerator.gather_for_metrics((index, batch_logits))
            logits[index.cpu()] = batch_logits.cpu()
    return logits
