"""Trained models read back for export, predict and report: from an exported folder or from a step_<N> checkpoint,
whichever strategy wrote it (one process, DDP, ZeRO-2/3, FSDP), and the run's config they were trained with.
"""

import dataclasses
import glob
import json
import os
import pickle
import tempfile

import torch
from accelerate import Accelerator
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoConfig

from textclf.checkpointing import (
    FSDP_SHARDED,
    POSITION,
    STEP_DIR,
    authorship,
    read_position,
    read_verified_position,
    refuse_pickle_unless_allowed,
    verify_checkpoint,
    weights_only_loads,
)
from textclf.config import CONSENT_FIELDS, TrainConfig, require_trained_model
from textclf.errors import InputError

from .build import lora_settings, make_model, needs_remote_code, refuse_custom_code
from .folder import TRAINING, load_model_folder, weight_files
from .tokenizer import load_folder_tokenizer


def load_trained(path: str, allow_pickle: bool = False, trust_remote_code: bool = False):
    """(model, tokenizer) from an exported model folder or a step_<N> checkpoint; the model in eval mode.

    A checkpoint's pickles are read as a resume reads them (checkpointing's pickles): DeepSpeed's weights-only, and
    the metadata of FSDP's distributed checkpoint, a full pickle, only where this user's run signed the checkpoint
    or `allow_pickle` is given.
    `trust_remote_code` lets the folder's own Python code (its config's auto_map) run; it is passed to
    transformers as False otherwise, never None, which would ask on the terminal and run the code on "y".
    """
    require_trained_model(path)
    if os.path.isfile(os.path.join(path, POSITION)) or STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        return load_checkpoint(path, allow_pickle, trust_remote_code)
    if glob.glob(os.path.join(path, "*.json")) or weight_files(path):
        return load_model_folder(path, trust_remote_code)
    raise InputError(f"{path} is neither a model folder (config.json and weights, as export writes) nor a "
                     f"step_<N> checkpoint ({POSITION}, as train.py writes)")


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


def load_checkpoint(checkpoint: str, allow_pickle: bool, trust_remote_code: bool):
    position = read_verified_position(checkpoint)
    refuse_pickle_unless_allowed(checkpoint, authorship(checkpoint, position), allow_pickle)
    verify_checkpoint(checkpoint, position)  # every file read in full before any is loaded
    try:
        config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            raise needs_remote_code(checkpoint) from None  # else: the message below says more than the cause
        raise InputError(f"{checkpoint} is not a complete checkpoint: it has no readable config.json") from None
    refuse_custom_code(checkpoint, getattr(config, "auto_map", None), trust_remote_code)
    try:
        weights = checkpoint_weights(checkpoint, allow_pickle)
    # What safetensors, torch.load and DeepSpeed's consolidation raise on a truncated or damaged file.
    except (SafetensorError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise InputError(f"cannot read the weights of {checkpoint}: {(str(e).splitlines() or [type(e).__name__])[0]} "
                         "(a damaged or incomplete file; use another step_<N>)") from None
    # The run's own LoRA settings rebuild the same adapters, which the weights hold.
    model = make_model(config, weights, lora=lora_settings(position.get("config") or {}), source=checkpoint,
                       trust_remote_code=trust_remote_code)
    return model.eval(), load_folder_tokenizer(os.path.join(checkpoint, "tokenizer"), trust_remote_code)


def checkpoint_weights(checkpoint: str, allow_pickle: bool) -> dict:
    """The full weights in a step_<N> checkpoint, whichever strategy wrote it."""

    path = os.path.join(checkpoint, "model.safetensors")
    if os.path.isfile(path):  # one process or DDP: accelerate's save_state writes the whole model
        return load_file(path)
    if os.path.isfile(os.path.join(checkpoint, "latest")):  # DeepSpeed: shards per rank, under the tag in `latest`
        # DeepSpeed's own consolidation (what the zero_to_fp32.py beside the shards runs): the fp32
        # master weights of ZeRO-1/2/3, frozen parameters included.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with weights_only_loads(checkpoint, deepspeed=True, allow_pickle=allow_pickle):
            return get_fp32_state_dict_from_zero_checkpoint(checkpoint)
    path = os.path.join(checkpoint, FSDP_SHARDED)
    if os.path.isdir(path):  # FSDP with SHARDED_STATE_DICT: a torch.distributed.checkpoint folder
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:  # torch's own consolidation, on one process
            dcp_to_torch_save(path, os.path.join(tmp, "model.pt"))
            return torch.load(os.path.join(tmp, "model.pt"), weights_only=True)["model"]
    path = os.path.join(checkpoint, "pytorch_model_fsdp.bin")
    if os.path.isfile(path):  # FSDP with FULL_STATE_DICT: plain tensors, which torch loads without pickle
        return torch.load(path, map_location="cpu", weights_only=True)
    raise InputError(f"{checkpoint} is not a complete checkpoint: it holds no model weights (model.safetensors, "
                     "DeepSpeed's shards and their `latest` file, or FSDP's pytorch_model_fsdp*)")


def inference_accelerator() -> Accelerator:
    """One process, or as many as `accelerate launch` starts. Without CUDA, `cpu=True` is what makes
    a multi-process launch form a gloo group; inference needs no DeepSpeed."""
    return Accelerator(cpu=not torch.cuda.is_available())


def label_names(model) -> list[str]:
    return [model.config.id2label[i] for i in range(model.config.num_labels)]


def run_config(model_path: str, options: dict) -> TrainConfig:
    """The config of the run that trained `model_path` (defaults where it has none), with `options` given
    here (those not None) winning: what predict and report take the task and columns from."""
    known = {field.name for field in dataclasses.fields(TrainConfig)}
    # The run's best-checkpoint metric is of no use here, and may not be a score of a task given here; the consents
    # are this command's own.
    saved = {key: value for key, value in read_training(model_path).get("config", {}).items()
             if key in known and key != "metric_for_best_model" and key not in CONSENT_FIELDS}
    return TrainConfig(**{**saved, **{key: value for key, value in options.items() if value is not None}})
