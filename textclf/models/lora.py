"""LoRA (--lora, peft): adapters put on a model, and a LoRA model folder written. Imported only by a run or a folder
that has them: it needs peft.

A LoRA folder holds the base model (config.json, model.safetensors) and, beside it, the adapter with the trained
head (adapter_config.json, adapter_model.safetensors): transformers and `pipeline` load it as that base plus that
adapter, from anywhere the folder is moved, offline; a scratch base exists nowhere else.
"""

import warnings

from peft import LoraConfig, TaskType, get_peft_model
from transformers import PreTrainedModel

from textclf.errors import InputError, verbose


def apply_lora(model: PreTrainedModel, r: int, alpha: int, dropout: float, target_modules=None):
    """Wrap `model` for LoRA: adapters on `target_modules` (None: peft's default for the model type, query and
    value for BERT), the head trained in full: every top-level module outside the backbone (BERT's `classifier`,
    DistilBERT's `pre_classifier` and `classifier`, ...), which starts untrained."""
    head = [name for name, module in model.named_children()
            if name != model.base_model_prefix and any(True for _ in module.parameters())]
    # peft's sequence-classification task adds `classifier` and `score` by itself.
    extra_head = [name for name in head if name not in ("classifier", "score")]
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=target_modules, modules_to_save=extra_head or None)
    try:
        with warnings.catch_warnings():
            if not verbose():  # peft reads transformers' deprecated `is_gradient_checkpointing`: not the user's to fix
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated",
                                        category=FutureWarning)
            return get_peft_model(model, config)
    except ValueError as e:  # target modules that the model does not have, or a model type peft does not know
        raise InputError(f"cannot apply LoRA to {model.config.model_type}: {str(e).splitlines()[0]} "
                         "(choose modules with --lora_target_modules)") from None


def save_adapter(model, folder: str, target: str) -> None:
    """Write the adapter and, beside it, the base it applies to (the module's docstring) into `folder`, which
    becomes `target`, named as the base."""
    name_base(model, target)
    # No embedding layers: LoRA leaves the vocabulary as it was ("auto" would look for the base at its name,
    # not written yet).
    model.save_pretrained(folder, save_embedding_layers=False)
    model.unload().save_pretrained(folder)


def name_base(model, folder: str) -> None:
    """Name `folder` as the adapter's base, in adapter_config.json and in the model card peft writes.

    peft's loaders (AutoPeftModel*.from_pretrained, and whoever loads the base by that name for
    PeftModel.from_pretrained) load the base from that name alone. The base the run started from would not do:
    its head has its own number of labels, a decoder's config has no pad token, and a scratch base or a
    step_<N> checkpoint is nowhere to load from. transformers and `pipeline` read the base in the folder
    whatever the name says.
    """
    for config in model.peft_config.values():
        config.base_model_name_or_path = folder
    model.get_base_model().config._name_or_path = folder  # what peft's model card names as the base
