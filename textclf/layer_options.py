"""What two options do to the model's repeated layers, run only when one is on: --torch_compile (by default on a
GPU) compiles each block in place, --gradient_checkpointing recomputes their activations in the backward pass."""

import torch
from transformers import PreTrainedModel

from .errors import InputError
from .modeling import layer_classes


def compile_blocks(model: torch.nn.Module, **compile_kwargs) -> int:
    """Compile each of the model's repeated blocks (layer_classes) in place with `nn.Module.compile`, which keeps
    the modules, their names and state_dict keys; returns how many.

    Only the blocks, not the modules around them (accelerate's regional compilation compiles those too): compiled,
    an embedding's backward adds its rows' gradients with atomic adds over threads, in an order that changes from
    run to run, which a bitwise resume cannot have; and the blocks are where the time goes.
    """
    classes = set(layer_classes(model))
    blocks = [module for module in model.modules() if type(module).__name__ in classes]
    for block in blocks:
        block.compile(**compile_kwargs)
    return len(blocks)


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    # Non-reentrant: gradients reach LoRA's adapters through a frozen embedding without
    # `enable_input_require_grads`. transformers 5 renamed the method (the old name warns).
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    try:
        enable({"use_reentrant": False})
    except ValueError as e:
        raise InputError(f"--gradient_checkpointing: {str(e).splitlines()[0]}") from None
