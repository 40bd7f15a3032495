"""The speed options a run turns on (by default, on a CUDA GPU): TF32, Liger's kernels and torch.compile.

The repeated blocks are compiled in place (`nn.Module.compile`): the modules and their state_dict keys stay what they
were, so checkpoints, the export and a resume without compiling are unchanged. Shapes are static, each batch length
padded up to one of at most 8 buckets (padding_multiple): each shape's kernels are then the same whatever shape a
run met first, which a resume needs to replay the run bit for bit. A launch's dynamo settings (backend, mode,
fullgraph, dynamic) are taken, and accelerate's own compile of the whole model, which would rename every weight
`_orig_mod.*`, is turned off.
"""

import math
import sys
import time
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, DynamoBackend

from textclf.config import TrainConfig
from textclf.errors import InputError
from textclf.launch import set_for_the_run, until_the_run_ends

from .build import layer_classes


def speed_up(model: torch.nn.Module, cfg: TrainConfig, accelerator: Accelerator) -> dict:
    """TF32, Liger's kernels and torch.compile as their flags ask, applied to `model` in place before
    `accelerator.prepare`; what was applied, for run.json."""
    settings = resolve_speed(cfg, accelerator.device.type == "cuda", accelerator.distributed_type,
                             accelerator.state.dynamo_plugin, getattr(model.config, "model_type", None))
    settings["padding_multiple"] = padding_multiple(cfg, accelerator)
    # Set either way on a GPU: a launch with a dynamo backend and no mixed precision has accelerate turn TF32 on.
    if accelerator.device.type == "cuda":
        precision = "tf32" if settings["tf32"] else "ieee"
        set_for_the_run(torch.backends.cuda.matmul, "fp32_precision", precision)
        set_for_the_run(torch.backends.cudnn.conv, "fp32_precision", precision)
    if settings["use_liger_kernel"]:
        apply_liger(model)
    if settings["torch_compile"]:
        compile_model(model, settings["torch_compile"], accelerator)
    return settings


def resolve_speed(cfg: TrainConfig, cuda: bool, distributed_type: DistributedType, dynamo_plugin,
                  model_type: Optional[str]) -> dict:
    """{tf32, use_liger_kernel, torch_compile (its keywords, or None)}: the flags, with auto (None) decided by the
    hardware, the launch and the model's family; a value the run cannot honour is refused."""
    compile_kwargs = None
    if compiles(cfg, cuda, distributed_type, dynamo_plugin):
        compile_kwargs = compile_options(dynamo_plugin)
    liger = False
    if cfg.use_liger_kernel or (cfg.use_liger_kernel is None and cuda):
        liger = use_liger(cfg.use_liger_kernel, cuda, model_type)
    return {"tf32": cuda if cfg.tf32 is None else cfg.tf32 and cuda, "use_liger_kernel": liger,
            "torch_compile": compile_kwargs}


def compiles(cfg: TrainConfig, cuda: bool, distributed_type: DistributedType, dynamo_plugin) -> bool:
    """Whether the run compiles its blocks: --torch_compile, or auto: with CUDA for one process or DDP, or when the
    launch asks for a dynamo backend."""
    launched = dynamo_plugin.backend != DynamoBackend.NO
    if cfg.torch_compile is False and launched:
        raise InputError(f"--torch_compile false, but the launch asks for dynamo_backend "
                         f"{dynamo_plugin.backend.value.lower()}: leave one of them out")
    sharded = distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
    return cfg.torch_compile if cfg.torch_compile is not None else launched or (cuda and not sharded)


def padding_multiple(cfg: TrainConfig, accelerator: Accelerator) -> Optional[int]:
    """What batch lengths are padded up to a multiple of: compiling, max_length / 8 rounded up to a multiple of 8
    (at most 8 buckets, each compiled once); else 8 in 16-bit precision, tensor cores' multiple, and none in fp32."""
    if compiles(cfg, accelerator.device.type == "cuda", accelerator.distributed_type, accelerator.state.dynamo_plugin):
        return 8 * math.ceil(cfg.max_length / 64)
    return 8 if accelerator.mixed_precision != "no" else None


# Liger's loss kernels, off: its fused linear cross-entropy replaces the model's forward with a causal LM's (a
# classifier has no lm_head: the first step would fail), and its cross_entropy patches torch's for every model.
LIGER_KERNELS = {"fused_linear_cross_entropy": False, "cross_entropy": False}


def compile_options(dynamo_plugin) -> dict:
    """torch.compile's keywords for the blocks: static shapes on inductor, or the launch's dynamo settings."""
    compile_kwargs = {"backend": "inductor", "dynamic": False}
    if dynamo_plugin.backend != DynamoBackend.NO:
        compile_kwargs.update({key: value for key, value in dynamo_plugin.to_kwargs().items()
                               if value is not None and key != "disable"})
    if compile_kwargs["backend"] == "inductor":
        # No kernel chosen by timing it where the choice changes the numerics: a resumed run compiles its
        # kernels again and must pick the ones the run it continues picked. torch.compile takes a mode or
        # options, not both: a mode becomes its options (the way torch.compile's documentation lists them).
        from torch._inductor import list_mode_options

        mode = compile_kwargs.pop("mode", None) or "default"
        compile_kwargs["options"] = {**list_mode_options(mode), "deterministic": True,
                                     **compile_kwargs.get("options", {})}
    return compile_kwargs


def compile_model(model: torch.nn.Module, compile_kwargs: dict, accelerator) -> None:
    # Each length bucket, batch size and mode (train, eval) of a block is a graph of its own; dynamo's default
    # limit of 8 would run the rest eagerly, differently from a run that met them in another order.
    set_for_the_run(torch._dynamo.config, "recompile_limit", max(torch._dynamo.config.recompile_limit, 64))
    compile_blocks(model, **compile_kwargs)
    # Compiled here, once: prepare() must not compile the whole model again.
    set_for_the_run(accelerator.state.dynamo_plugin, "backend", DynamoBackend.NO)
    CompileClock.start(accelerator.is_local_main_process)


def apply_liger(model: torch.nn.Module) -> None:
    """Liger's kernels on `model` alone, through the Trainer's own call: its norms and MLPs patched on the instances.

    Left out: what changes other models than this one. liger-kernel also swaps the family's classes and functions
    (RoPE's among them) in transformers' modeling modules, which would reach the export's CPU copy (Triton kernels do
    not run there) and any later model of the process: they are put back at once. And its losses (LIGER_KERNELS).
    """
    from transformers.integrations.liger import apply_liger_kernel

    loaded = {name: module for name, module in sys.modules.items()
              if name.startswith("transformers.models.") and module is not None}
    before = {name: dict(vars(module)) for name, module in loaded.items()}
    try:
        apply_liger_kernel(model, dict(LIGER_KERNELS))
    finally:
        for name, module in loaded.items():
            namespace = vars(module)
            for added in set(namespace) - set(before[name]):
                del namespace[added]
            namespace.update(before[name])
        for name in [name for name in sys.modules if name.startswith("transformers.models.") and name not in loaded]:
            del sys.modules[name]  # imported by liger to patch it (a family's apply may reach another's): imported anew


def use_liger(asked: Optional[bool], cuda: bool, model_type: Optional[str]) -> bool:
    """--use_liger_kernel (None: auto, on where CUDA and liger-kernel cover the model's family); refused where
    asked for and it cannot apply."""
    covered = liger_covers(model_type)
    if asked is None:
        return cuda and bool(covered)
    if not (cuda and covered):
        why = ("needs a CUDA GPU (Triton kernels)" if not cuda else "needs liger-kernel: pip install -e '.[liger]'"
               if covered is None else f"liger-kernel has no kernels for model type {model_type}")
        raise InputError(f"--use_liger_kernel {why}")
    return True


def liger_covers(model_type: Optional[str]) -> Optional[bool]:
    """Whether liger-kernel has kernels for this model type; None when liger-kernel is not installed."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:  # not installed, or installed without what it needs (triton)
        return None
    return model_type in MODEL_TYPE_TO_APPLY_LIGER_FN


class CompileClock:
    """The seconds torch.compile spends compiling in the first step, said once, when that step's optimizer step
    ends (torch's global optimizer hook).

    Dynamo's compile callbacks (`torch._dynamo.callback_handler`, not in torch.compiler's public API) bracket every
    compilation: the forward's, and the backward's where it is compiled lazily (a cache hit compiles it at once).
    """

    seconds, started, local_main, said = 0.0, None, False, None

    @classmethod
    def start(cls, local_main: bool) -> None:
        cls.seconds, cls.started, cls.local_main = 0.0, None, local_main
        handler = torch._dynamo.callback_handler
        if cls.on_start not in handler.start_callbacks:
            handler.register_start_callback(cls.on_start)
            handler.register_end_callback(cls.on_end)
        if cls.said is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            cls.said = register_optimizer_step_post_hook(cls.say)
        until_the_run_ends(cls.stop)

    @classmethod
    def stop(cls) -> None:
        """Dynamo's callbacks and the optimizer hook taken down: the process compiles and steps as before the run."""
        handler = torch._dynamo.callback_handler
        if cls.on_start in handler.start_callbacks:
            handler.remove_start_callback(cls.on_start)
            handler.remove_end_callback(cls.on_end)
        if cls.said is not None:
            cls.said.remove()
            cls.said = None

    @classmethod
    def on_start(cls, args) -> None:
        cls.started = time.perf_counter()

    @classmethod
    def on_end(cls, args) -> None:
        if cls.started is not None:
            cls.seconds += time.perf_counter() - cls.started
            cls.started = None

    @classmethod
    def say(cls, optimizer, args, kwargs) -> None:
        cls.said.remove()
        cls.said = None
        if cls.local_main:
            print(f"torch.compile: the model's blocks compiled in {cls.seconds:.1f} s, in the first step "
                  "(--torch_compile false runs without)", flush=True)


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
