"""DeepSpeed's universal checkpoint: a ZeRO checkpoint resumed on another number of processes.

ZeRO partitions its optimizer states (and, at stage 3, the weights) over the processes that saved them. DeepSpeed's
ds_to_universal converts them to one file per parameter and state, which any number of processes loads with
`"checkpoint": {"load_universal": true}` (train.py's Accelerator sets it). Imported only by such a resume: it needs
deepspeed.
"""

import contextlib
import io
import os
import shutil
import sys

import torch
from accelerate import Accelerator

from textclf import files
from textclf.errors import WRITE_ERRORS, InputError, checked_on_main_process, verbose, write_failed

from .folders import UNIVERSAL

DEEPSPEED_TAG = "pytorch_model"  # the folder accelerate's save_state has DeepSpeed write its states into


def universal_copy(accelerator: Accelerator, checkpoint: str, output_dir: str) -> str:
    """Collective: a folder that `accelerator.load_state` reads as `checkpoint`, with DeepSpeed's states
    converted to its universal checkpoint (deepspeed.checkpoint.ds_to_universal: one file per parameter and
    state, which any number of processes loads with `"checkpoint": {"load_universal": true}`). Accelerate's own
    files are linked, not copied. The main process converts; the folder is removed once loaded
    (after_universal_load), or by the next start if the run is killed first."""
    folder = os.path.join(output_dir, UNIVERSAL + os.path.basename(os.path.normpath(checkpoint)))

    def convert():
        from argparse import Namespace

        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        refuse_round_robin(checkpoint)
        try:
            files.new_folder(folder)
        except OSError as e:
            raise write_failed("convert to a universal checkpoint", checkpoint, e,
                               f"make {output_dir} writable, then run again") from None
        for name in os.listdir(checkpoint):
            if name != DEEPSPEED_TAG:
                os.symlink(os.path.abspath(os.path.join(checkpoint, name)), os.path.join(folder, name))
        # DeepSpeed's script, called as its command line would call it; what it prints (its arguments, "*** 2.
        # Merging slices", bars) is its own progress, which the resume's line says in one (TEXTCLF_VERBOSE=1 shows it).
        said = io.StringIO()
        try:
            with contextlib.redirect_stdout(sys.stdout if verbose() else said), \
                    contextlib.redirect_stderr(sys.stderr if verbose() else said):
                ds_to_universal(Namespace(input_folder=os.path.join(checkpoint, DEEPSPEED_TAG),
                                          output_folder=os.path.join(folder, DEEPSPEED_TAG), num_extract_workers=1,
                                          num_merge_workers=1, keep_temp_folder=False, strict=True,
                                          inject_missing_state=True))
        except WRITE_ERRORS as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise write_failed("convert to a universal checkpoint", checkpoint, e,
                               f"free space in {output_dir}, then run again") from None

    checked_on_main_process(accelerator, convert)
    return folder


def refuse_round_robin(checkpoint: str) -> None:
    """DeepSpeed's conversion misplaces the parameters of a ZeRO-1/2 checkpoint saved with
    `round_robin_gradients` by more than one process (it reads them back in the order they were declared, not
    in the round-robin order of the partitions): measured, then refused rather than trained on. The zoo's
    DeepSpeed files leave it off."""
    tag = os.path.join(checkpoint, DEEPSPEED_TAG)
    states = sorted(name for name in os.listdir(tag) if name.endswith("model_states.pt"))
    config = torch.load(os.path.join(tag, states[0]), map_location="cpu", weights_only=False).get("ds_config", {})
    zero = config.get("zero_optimization", {})
    if zero.get("round_robin_gradients") and zero.get("stage") in (1, 2):
        raise InputError(f"cannot resume {checkpoint} on another number of processes: it was saved with "
                         '"round_robin_gradients": true, whose partitions DeepSpeed\'s universal checkpoint '
                         "misreads; resume it on the number of processes that made it")


def group_settings(optimizer) -> list[dict]:
    """Each parameter group's own settings, which after_universal_load puts back: DeepSpeed's universal load gives
    every group the first group's ("generally the same", stage3.py), and the no-decay group would be decayed."""
    return [{key: value for key, value in group.items() if key not in ("params", "lr")}
            for group in optimizer.param_groups]


def after_universal_load(accelerator: Accelerator, optimizer, folder: str, settings: list[dict]) -> None:
    """Collective, once `accelerator.load_state(folder)` has read universal_copy's folder: put back what
    DeepSpeed's universal load changes that an uninterrupted run would not have, then remove the folder."""
    # It gives every ZeRO-3 partition one shared `step` tensor, which fused AdamW then increments in place
    # once per partition at each step: each gets its own. (optimizer.optimizer is DeepSpeed's ZeRO optimizer,
    # its .optimizer the torch one; tests/checkpointing/test_load.py's ZeRO-3 resumes fail if either changes.)
    for state in optimizer.optimizer.optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(folder, ignore_errors=True)
