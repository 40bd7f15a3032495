"""Trained models read back: from an exported folder or from a step_<N> checkpoint, whichever
strategy wrote it (one process, DDP, ZeRO-2/3, FSDP), for export, predict and report.

An exported folder is a Hugging Face model folder. With LoRA it holds the base model (config.json,
model.safetensors) and, beside it, the adapter with the trained head (adapter_config.json,
adapter_model.safetensors): transformers and `pipeline` load such a folder as that base plus that
adapter, from any working directory and wherever the folder is moved, offline; a scratch base exists
nowhere else. (`base_model_name_or_path` in adapter_config.json names the folder as export wrote it, for
peft's loaders, which load the base from that name; transformers does not follow it for a folder that holds
its own config.json.)
"""

import glob
import json
import os
import pickle
import tempfile

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

from .checkpoint import FSDP_SHARDED, POSITION, STEP_DIR, read_position, read_verified_position, verify_checkpoint
from .config import require_trained_model
from .errors import InputError
from .modeling import apply_lora, load_refused, needs_remote_code, pickled_weights

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# In an exported folder: the resolved config of the run that trained it and its data fingerprint, so that
# predict and report know the task and columns (a checkpoint's position.json holds the same).
TRAINING = "training.json"


def load_trained(path: str, allow_pickle: bool = False, trust_remote_code: bool = False):
    """(model, tokenizer) from an exported model folder or a step_<N> checkpoint; the model in eval mode.

    `allow_pickle` lets a DeepSpeed or FSDP-sharded checkpoint load: DeepSpeed's files and the
    metadata of FSDP's distributed checkpoint are full pickles, which can run code stored in them.
    `trust_remote_code` lets the folder's own Python code (its config's auto_map) run; it is passed to
    transformers as False otherwise, never None, which would ask on the terminal and run the code on "y".
    """
    require_trained_model(path)
    if os.path.isfile(os.path.join(path, POSITION)) or STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        model, tokenizer = _load_checkpoint(path, allow_pickle, trust_remote_code)
    elif glob.glob(os.path.join(path, "*.json")) or weight_files(path):
        model, tokenizer = _load_folder(path, trust_remote_code)
    else:
        raise InputError(f"{path} is neither a model folder (config.json and weights, as export writes) nor a "
                         f"step_<N> checkpoint ({POSITION}, as train.py writes)")
    return model.eval(), tokenizer


def read_training(path: str) -> dict:
    """{"config": the training config, "data_fingerprint": ...} of the run that made a model folder or
    checkpoint; {} for a folder that export did not write (a model from elsewhere, or an older export)."""
    if os.path.isfile(os.path.join(path, POSITION)):
        position = read_position(path)
        return {key: position[key] for key in ("config", "data_fingerprint") if key in position}
    file = os.path.join(path, TRAINING)
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{file} is unreadable: {e}") from None


def weight_files(folder: str) -> list[str]:
    """The safetensors files of a model folder (export writes nothing else), the LoRA adapter's included."""
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def base_weight_files(folder: str) -> list[str]:
    """The model's own safetensors files, without a LoRA adapter's."""
    return [path for path in weight_files(folder) if os.path.basename(path) != ADAPTER_WEIGHTS]


def require_model_files(folder: str) -> None:
    """A model folder needs its config and its weights; say which one is missing."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise InputError(f"{folder} is not a complete model folder: it has no config.json")
    if not base_weight_files(folder) and not glob.glob(os.path.join(folder, "pytorch_model*.bin")):
        raise InputError(f"{folder} is not a complete model folder: it has no weights (model.safetensors)")


def _load_folder(folder: str, trust_remote_code: bool):
    from peft import PeftModel

    lora = os.path.isfile(os.path.join(folder, ADAPTER_CONFIG))
    require_model_files(folder)
    if lora and not os.path.isfile(os.path.join(folder, ADAPTER_WEIGHTS)):
        raise InputError(f"{folder} is not a complete LoRA model folder: it has no {ADAPTER_WEIGHTS}")
    try:
        if lora:
            # The base alone, from its own files: from_pretrained(folder) would add the adapter beside it,
            # and peft's PeftModel (which export merges) must add it instead.
            config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
            state_dict = {name: tensor for path in base_weight_files(folder)
                          for name, tensor in load_file(path).items()}
            model, info = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(config)].from_pretrained(
                None, config=config, state_dict=state_dict, output_loading_info=True)
        else:
            model, info = AutoModelForSequenceClassification.from_pretrained(
                folder, output_loading_info=True, trust_remote_code=trust_remote_code)
    except SafetensorError as e:
        raise InputError(f"cannot load a model from {folder}: a weights file is damaged or incomplete "
                         f"({str(e).splitlines()[0]}); export it again") from None
    except (OSError, ValueError, KeyError) as e:
        raise load_refused(folder, e, f"cannot load a model from {folder}") from None
    except pickle.UnpicklingError:  # torch.load's weights_only refused a pickle that holds more than tensors
        raise pickled_weights(folder) from None
    # from_pretrained fills missing weights with random ones and only warns: refuse instead.
    incomplete = info["missing_keys"] or info["mismatched_keys"]
    if incomplete:
        raise InputError(f"{folder}: weights missing or of the wrong shape for its config: "
                         f"{', '.join(sorted(map(str, incomplete))[:3])}")
    if lora:
        model = PeftModel.from_pretrained(model, folder)
    return model, _load_tokenizer(folder, trust_remote_code)


def _load_checkpoint(checkpoint: str, allow_pickle: bool, trust_remote_code: bool):
    position = read_verified_position(checkpoint)
    verify_checkpoint(checkpoint, position)  # every file read in full before any is loaded
    run = position.get("config") or {}
    try:
        config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            raise needs_remote_code(checkpoint) from None  # else: the message below says more than the cause
        raise InputError(f"{checkpoint} is not a complete checkpoint: it has no readable config.json") from None
    try:
        model = AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise load_refused(checkpoint, e, f"cannot build the model of {checkpoint}") from None
    if run.get("lora"):  # the run's own settings rebuild the same adapters
        model = apply_lora(model, run["lora_r"], run["lora_alpha"], run["lora_dropout"], run["lora_target_modules"])
    try:
        weights = checkpoint_weights(checkpoint, allow_pickle)
    # What safetensors, torch.load and DeepSpeed's consolidation raise on a truncated or damaged file.
    except (SafetensorError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise InputError(f"cannot read the weights of {checkpoint}: {(str(e).splitlines() or [type(e).__name__])[0]} "
                         "(a damaged or incomplete file; use another step_<N>)") from None
    load_weights(model, weights, checkpoint)
    return model, _load_tokenizer(os.path.join(checkpoint, "tokenizer"), trust_remote_code)


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
    path = os.path.join(checkpoint, FSDP_SHARDED)
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


def _load_tokenizer(folder: str, trust_remote_code: bool):
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise load_refused(folder, e, f"cannot load the tokenizer saved in {folder}") from None
