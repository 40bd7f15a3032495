"""What a checkpoint's pickles may run: nothing, where the libraries allow it.

Accelerate reads its own files (optimizer, scheduler, RNG states) with `weights_only=True`, and the weights come from
safetensors. DeepSpeed reads its files with full pickle (`torch.load(..., weights_only=False)`), though they hold
tensors and four classes of its own: they are read weights-only here too, those classes allowed, whoever wrote the
checkpoint. torch.distributed.checkpoint (FSDP's sharded state) reads its `.metadata` with `pickle.load`, which
has no weights-only mode: that file is read only for a checkpoint this user's run signed, or with --allow_pickle.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import sys
import warnings
from typing import Optional

from textclf.errors import InputError, say

from .folders import FSDP_SHARDED

# What DeepSpeed's checkpoint files pickle besides tensors and plain containers (ZeRO-1/2/3, offload, bf16, fp16).
DEEPSPEED_CLASSES = {
    "deepspeed.runtime.zero.config": ("ZeroStageEnum",),
    "deepspeed.runtime.fp16.loss_scaler": ("LossScaler", "DynamicLossScaler"),
    "deepspeed.utils.tensor_fragment": ("fragment_address",),
}

# torch's switch that makes every torch.load read weights only, even where the caller passed weights_only=False.
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


def full_pickle_writer(checkpoint: str) -> Optional[str]:
    """Who wrote the checkpoint's files that load only with full pickle, whoever signed it: FSDP's sharded state."""
    return "FSDP" if os.path.isdir(os.path.join(checkpoint, FSDP_SHARDED)) else None


def refuse_pickle_unless_allowed(checkpoint: str, unproven: Optional[str], allow_pickle: bool) -> None:
    """A checkpoint from elsewhere (`unproven`: why nothing proves this user's run wrote it) is read without pickle,
    or refused where a file needs it, unless the user passed --allow_pickle; said in one line either way."""
    if unproven is None:
        return
    writer = full_pickle_writer(checkpoint)
    if writer and not allow_pickle:
        raise InputError(f"{checkpoint} was written elsewhere ({unproven}), and {writer}'s files load only with full "
                         "pickle, which can run code stored in them; pass --allow_pickle if you trust this checkpoint")
    how = "with full pickle, as --allow_pickle allows" if allow_pickle else "without running any code they hold"
    say(f"warning: nothing proves that this user's runs wrote {checkpoint}: {unproven}. Its files are checked "
        f"against its sha256 records alone, and read {how}", file=sys.stderr)


@contextlib.contextmanager
def weights_only_loads(checkpoint: str, deepspeed: bool, allow_pickle: bool = False):
    """While `checkpoint` loads: every torch.load inside reads weights only, DeepSpeed's own calls too, with
    DeepSpeed's classes allowed where `deepspeed`; a file that holds more is one line, and nothing of it runs. With
    --allow_pickle (`allow_pickle`) the loads are left as their callers ask. Put back as it was at the end."""
    if allow_pickle:
        yield
        return
    import importlib

    import torch

    allowed = [getattr(importlib.import_module(module), name) for module, names in DEEPSPEED_CLASSES.items()
               for name in names] if deepspeed else []
    before = os.environ.get(FORCE_WEIGHTS_ONLY)
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
            # A file pickled by pickle itself, not torch.save: refused all the same, and said in the line below.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            yield
    except pickle.UnpicklingError as e:  # torch's weights-only unpickler met a class it was not told to allow
        found = re.search(r"Unsupported (global: GLOBAL [\w.]+|operand \S+)", str(e))
        unsupported = found.group(0) if found else "a pickle torch would not read weights-only"
        raise InputError(f"cannot load checkpoint {checkpoint}: a file of it holds more than tensors and the classes "
                         f"its writer pickles ({unsupported}), and nothing of it was run; use another checkpoint, or "
                         "pass --allow_pickle if you trust whoever wrote it") from None
    finally:
        if before is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = before
