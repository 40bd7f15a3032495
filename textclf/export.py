"""Export: a self-contained Hugging Face model folder, written atomically and checked after writing."""

import os
import shutil

from accelerate import Accelerator
from safetensors import safe_open
from transformers import AutoConfig

from .config import InputError


def export_model(accelerator: Accelerator, model, tokenizer, target: str) -> str:
    """Collective: every rank calls it (ZeRO-3 gathers the shards).

    `accelerator.get_state_dict` returns full weights whatever the strategy; plain
    `unwrap_model(model).save_pretrained` would write empty tensors under ZeRO-3, and
    `accelerator.save_model` writes no config.json.
    """
    state_dict = accelerator.get_state_dict(model)
    tmp = f"{target}.incomplete"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        verify_weights(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    accelerator.wait_for_everyone()
    return target


def weight_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


def verify_weights(folder: str) -> None:
    """Every saved tensor is non-empty, and the folder has a config to rebuild the model from."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise InputError(f"{folder} has no config.json")
    files = weight_files(folder)
    if not files:
        raise InputError(f"{folder} has no safetensors weights")
    AutoConfig.from_pretrained(folder)
    for path in files:
        with safe_open(path, framework="pt") as weights:
            for name in weights.keys():
                if 0 in weights.get_slice(name).get_shape():
                    raise InputError(f"{path}: tensor {name} is empty (a ZeRO-3 shard saved without gathering?)")
