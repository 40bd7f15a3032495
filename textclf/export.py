"""Export: a trained classifier as a self-contained Hugging Face folder, written atomically and verified.

    python -m textclf.export checkpoints/step_500 exported/             # from any step_<N> checkpoint
    python -m textclf.export checkpoints/step_500 exported/ --merge     # LoRA merged into a plain model
    python -m textclf.export checkpoints/model merged/ --merge          # or from an exported LoRA folder

Whatever wrote the source (one process, DDP, ZeRO-2/3, FSDP), the folder holds safetensors weights,
a config with the task (`problem_type`, id2label), the tokenizer, and training.json (the config of the
run: task and columns, for predict and report); with LoRA, the base and the adapter beside it (see loading.py).
Before it takes the target's place it is checked: no empty tensor, it reloads, and it predicts what
the trained model predicts. train.py's export at the end of a run goes through the same `save_verified`.
"""

import argparse
import os
import shutil
from contextlib import contextmanager
from typing import Optional

from .config import add_loading_options, require_trained_model
from .errors import run_command


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m textclf.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a step_<N> checkpoint folder, or a model folder that export wrote")
    parser.add_argument("target", help="the folder to write (refused if it exists, unless --overwrite)")
    parser.add_argument("--merge", action="store_true", help="merge LoRA adapters into a plain model")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing target")
    add_loading_options(parser)
    args = parser.parse_args(argv)
    require_trained_model(args.source)
    return args


if __name__ == "__main__":
    # The command line first: --help and a mistyped flag answer at once, not after the imports below.
    ARGS = run_command(parse_args)

import torch
from accelerate import Accelerator
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification
from transformers.utils import logging as transformers_logging

from .checkpoint import write_json
from .errors import WRITE_ERRORS, InputError, write_failed
from .loading import TRAINING, load_trained, load_weights, read_training, weight_files
from .modeling import apply_lora
from .predict import predict_logits

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


def export_model(accelerator: Accelerator, model, tokenizer, target: str, merge: bool = False,
                 training: Optional[dict] = None, trust_remote_code: bool = False) -> str:
    """Export the model being trained, with `training` (the run's config and data fingerprint) in TRAINING.
    Collective: every rank calls it (ZeRO-3 gathers the shards).

    `accelerator.get_state_dict` returns full weights whatever the strategy; plain
    `unwrap_model(model).save_pretrained` would write empty tensors under ZeRO-3 (LoRA adapters
    too), and `accelerator.save_model` writes no config.json. The main process loads them into a
    fresh copy of the model and saves that, as `export_checkpoint` does with a checkpoint's weights.
    """
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        with transformers_without_zero3(accelerator):
            copy = copy_with_weights(accelerator.unwrap_model(model), state_dict, trust_remote_code)
            save_verified(copy, tokenizer, target, merge=merge, overwrite=True, training=training,
                          trust_remote_code=trust_remote_code)
    accelerator.wait_for_everyone()
    return target


def export_checkpoint(source: str, target: str, *, merge: bool = False, overwrite: bool = False,
                      allow_pickle: bool = False, trust_remote_code: bool = False) -> str:
    """Export a step_<N> checkpoint (or re-export a model folder, e.g. to merge its LoRA adapter), with the
    config of the run that made it."""
    refuse_existing(target, overwrite)  # before the slow part
    model, tokenizer = load_trained(source, allow_pickle, trust_remote_code)
    return save_verified(model, tokenizer, target, merge=merge, overwrite=overwrite, training=read_training(source),
                         trust_remote_code=trust_remote_code)


def copy_with_weights(model, state_dict: dict, trust_remote_code: bool = False):
    """A fresh CPU model of `model`'s architecture, LoRA adapters included, holding `state_dict`."""
    from peft import PeftModel

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    copy = AutoModelForSequenceClassification.from_config(base.config, trust_remote_code=trust_remote_code)
    if isinstance(model, PeftModel):
        lora = model.peft_config[model.active_adapter]
        copy = apply_lora(copy, lora.r, lora.lora_alpha, lora.lora_dropout, lora.target_modules)
    load_weights(copy, state_dict, "the trained model")
    return copy.eval()


@contextmanager
def transformers_without_zero3(accelerator: Accelerator):
    """Under ZeRO-3, transformers builds and loads every model partitioned over the ranks, which takes
    all of them; the export copy lives on the main process alone, so that is switched off meanwhile."""
    registered = getattr(accelerator.state.deepspeed_plugin, "dschf", None)  # what accelerate told transformers
    if registered is None:
        yield
        return
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(registered)


def save_verified(model, tokenizer, target: str, *, merge: bool = False, overwrite: bool = False,
                  training: Optional[dict] = None, trust_remote_code: bool = False) -> str:
    """Write `model` (plain or LoRA, full weights, on CPU), its tokenizer and `training` (TRAINING: the task
    and columns predict and report default to) to `target`, verified.

    The folder is written beside the target and checked before it takes the target's place: every
    tensor is non-empty, it loads the way predict and report load models, and its logits on
    PROBE_TEXTS equal the trained model's. `model` is used up: LoRA is merged or unloaded in place.
    """
    from peft import PeftModel

    refuse_existing(target, overwrite)
    expected = predict_logits(model, tokenizer, PROBE_TEXTS)
    parent, name = os.path.split(os.path.abspath(target))
    tmp = os.path.join(parent, f".{name}.incomplete")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an export that was killed
    try:
        try:
            if isinstance(model, PeftModel) and not merge:
                name_base(model, os.path.abspath(target))
                # adapter_config.json, adapter_model.safetensors: the adapters and the head. No embedding layers:
                # LoRA leaves the vocabulary as it was ("auto" would look for the base at its name, not written yet).
                model.save_pretrained(tmp, save_embedding_layers=False)
                model.unload().save_pretrained(tmp)  # beside them the base they apply to (loading.py: the layout)
            else:
                if isinstance(model, PeftModel):
                    model = model.merge_and_unload()  # W + BA: a plain model of the base architecture
                model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if training:
                write_json(os.path.join(tmp, TRAINING), training)
        except WRITE_ERRORS as e:
            raise write_failed("export the model to", target, e, "free space (or choose another place), then export "
                               "again: train.py --resume latest, or python -m textclf.export <step_N> <target>; "
                               "checkpoints are untouched") from None
        verify_weights(tmp)
        reloaded, reloaded_tokenizer = load_trained(tmp, trust_remote_code=trust_remote_code)
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
        shutil.rmtree(tmp, ignore_errors=True)  # already gone when it became the target
    return target


def name_base(model, folder: str) -> None:
    """Name `folder` (the export's target, which holds the base beside the adapter) as the adapter's base, in
    adapter_config.json and in the model card peft writes.

    peft's loaders (AutoPeftModel*.from_pretrained, and whoever reads the name to load the base for
    PeftModel.from_pretrained) load the base from that name alone. The base the run started from would not do:
    its head has its own number of labels, a decoder's config has no pad token, and a scratch base or a
    step_<N> checkpoint (whose weights are wrapped) is nowhere to load from. The folder itself holds the
    base with the trained config; transformers and `pipeline` read it there whatever the name says.
    """
    for config in model.peft_config.values():
        config.base_model_name_or_path = folder
    model.get_base_model().config._name_or_path = folder  # what peft's model card names as the base


def refuse_existing(target: str, overwrite: bool) -> None:
    if os.path.exists(target) and not overwrite:
        raise InputError(f"{target} already exists; choose another target or pass --overwrite to replace it")


def replace_folder(new: str, target: str) -> None:
    """Put `new` at `target`; an old target is only deleted once the new one is in its place."""
    old = f"{new}.old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(target):
        os.rename(target, old)
    os.rename(new, target)
    shutil.rmtree(old, ignore_errors=True)


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


def main(argv=None, args: Optional[argparse.Namespace] = None) -> None:
    args = args or parse_args(argv)
    transformers_logging.disable_progress_bar()  # one line per export is enough
    export_checkpoint(args.source, args.target, merge=args.merge, overwrite=args.overwrite,
                      allow_pickle=args.allow_pickle, trust_remote_code=args.trust_remote_code)
    print(f"exported {args.source} to {args.target} (verified: weights complete, reloads, same predictions)")


if __name__ == "__main__":
    run_command(lambda: main(args=ARGS))
