"""The Accelerator for the hardware at hand, and the facts about a run worth recording."""

import contextlib
import copy
import io
import json
import logging
import math
import os
import platform
import signal
import sys
import time
import warnings
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

import psutil
import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import DistributedType, DynamoBackend

from . import tracking
from .config import TrainConfig
from .errors import InputError, exit_now, verbose
from .launch import read_deepspeed_file, zero_offload


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    """One Accelerator for every zoo file, on GPUs and on a CPU-only machine alike.

    Without CUDA, a DDP yaml needs `cpu=True` to form a gloo process group (otherwise each rank
    runs alone), while DeepSpeed needs `cpu=False` and an explicit gloo backend (`cpu=True` would
    switch DeepSpeed off and silently run plain DDP).
    """
    has_cuda = torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if deepspeed and ds_file != "none":  # before anything is built: DeepSpeed itself reads it only at prepare()
        check_deepspeed_config(read_deepspeed_file(ds_file), ds_file)
    if deepspeed and not has_cuda:
        load_deepspeed_ops(["ShareMemCommBuilder"])  # what deepspeed.comm loads on a CPU, when the Accelerator starts
    if not verbose():  # DeepSpeed's calls of a torch function that torch deprecated: not the user's to fix
        warnings.filterwarnings("ignore", message=".*torch.distributed.all_gather_into_tensor.* is deprecated",
                                category=FutureWarning)
    with contextlib.redirect_stdout(io.StringIO()) as said:  # DeepSpeed prints "... built successfully" per rank
        accelerator = Accelerator(
            cpu=not has_cuda and not deepspeed,
            mixed_precision=cfg.mixed_precision,  # None: the launch's (ACCELERATE_MIXED_PRECISION), or "no"
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            # The schedule is defined in optimizer steps and stepped once per optimizer step (train.py).
            step_scheduler_with_optimizer=False,
            log_with=tracking.trackers(cfg.report_to, cfg.output_dir, cfg.project_name, cfg.run_name),
            project_dir=cfg.output_dir,
            # Per-epoch shuffles that depend on (seed, epoch) only: what makes resume replay the data order.
            # On a GPU, batches (pinned by the loaders) are copied without the host waiting for the device:
            # a blocking copy would wait for the previous step to finish before the next could be queued.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed,
                                                      non_blocking=has_cuda),
            kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if distributed and not has_cuda else [],
        )
    print("".join(line for line in said.getvalue().splitlines(keepends=True)
                  if verbose() or not line.endswith("built successfully\n")), end="")
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.deepspeed_config.get("gradient_clipping") == "auto":
        # Accelerate would fill "auto" with 1.0; the training config is the one source of truth.
        plugin.deepspeed_config["gradient_clipping"] = cfg.max_grad_norm
    if plugin is not None and zero_offload(plugin.deepspeed_config.get("zero_optimization", {}))["optimizer"] != "none":
        load_deepspeed_ops(["CPUAdamBuilder"])  # DeepSpeedCPUAdam, which accelerate swaps in at prepare()
    return accelerator


def speed_up(model: torch.nn.Module, cfg: TrainConfig, accelerator: Accelerator) -> dict:
    """TF32, Liger's kernels and torch.compile as --tf32, --use_liger_kernel and --torch_compile ask (None: auto),
    applied to `model` in place before `accelerator.prepare`; what was applied, for run.json.

    The repeated blocks are compiled in place (modeling.compile_blocks, `nn.Module.compile`): the modules and their
    state_dict keys stay what they were, so checkpoints, the export and a resume without compiling are unchanged.
    Shapes are static, each batch length padded up to one of at most 8 buckets (padding_multiple): each shape's
    kernels are then the same whatever shape a run met first, which a resume needs to replay the run bit for bit
    (with dynamic shapes the kernels are tuned to the first length seen). A launch's dynamo settings (backend, mode,
    fullgraph, dynamic) are taken here, and accelerate's own compile of the whole model, which would rename every
    weight `_orig_mod.*`, is turned off.
    """
    settings = resolve_speed(cfg, accelerator.device.type == "cuda", accelerator.distributed_type,
                             accelerator.state.dynamo_plugin, getattr(model.config, "model_type", None))
    settings["padding_multiple"] = padding_multiple(cfg, accelerator)
    if settings["tf32"]:
        torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "tf32"
    if settings["use_liger_kernel"]:
        from transformers.integrations.liger import apply_liger_kernel  # the Trainer's --use_liger_kernel

        apply_liger_kernel(model, None)
    if settings["torch_compile"]:
        from .modeling import compile_blocks

        # Each length bucket, batch size and mode (train, eval) of a block is a graph of its own; dynamo's default
        # limit of 8 would run the rest eagerly, differently from a run that met them in another order.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        compile_blocks(model, **settings["torch_compile"])
        # Compiled here, once: prepare() must not compile the whole model again.
        accelerator.state.dynamo_plugin.backend = DynamoBackend.NO
        CompileClock.start(accelerator.is_local_main_process)
    return settings


def resolve_speed(cfg: TrainConfig, cuda: bool, distributed_type: DistributedType, dynamo_plugin,
                  model_type: Optional[str]) -> dict:
    """{tf32, use_liger_kernel, torch_compile (torch.compile's keywords, or None)} for this run: the flags, with
    auto (None) decided by the hardware, the launch and the model's family. A value the run cannot honour is
    refused."""
    launched = dynamo_plugin.backend != DynamoBackend.NO
    compile_kwargs = None
    if compiles(cfg, cuda, distributed_type, dynamo_plugin):
        compile_kwargs = {"backend": "inductor", "dynamic": False}
        if launched:
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
    covered = liger_covers(model_type)
    liger = cfg.use_liger_kernel
    if liger is None:
        liger = cuda and bool(covered)
    elif liger and not (cuda and covered):
        why = ("needs a CUDA GPU (Triton kernels)" if not cuda else "needs liger-kernel: pip install -e '.[liger]'"
               if covered is None else f"liger-kernel has no kernels for model type {model_type}")
        raise InputError(f"--use_liger_kernel {why}")
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
    """What each batch's length is padded up to a multiple of. Compiling: max_length / 8, rounded up to a multiple
    of 8, so that lengths fall in at most 8 buckets, each compiled once. Otherwise 8 in 16-bit precision, the
    multiple tensor cores take (run_glue_no_trainer pads the same way), and none in fp32."""
    if compiles(cfg, accelerator.device.type == "cuda", accelerator.distributed_type, accelerator.state.dynamo_plugin):
        return 8 * math.ceil(cfg.max_length / 64)
    return 8 if accelerator.mixed_precision != "no" else None


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


def replay_cpu_adam_steps(optimizer) -> None:
    """Bring DeepSpeed's CPU Adam (the offload files' optimizer) to the resumed step the way it got there.

    Its C++ side keeps Adam's bias corrections beta^t as a running product, multiplied by beta at each step, and
    computes them as pow(beta, t) when a step does not follow the last one it saw (csrc/includes/cpu_adam.h,
    IncrementStep): a resumed run's first step. The two differ in their last bits, and so would every weight after.
    Its steps up to the checkpoint's are replayed here on a one-element tensor of its own, which builds the same
    running product; the model's weights and states are not touched. Other optimizers keep no such state.
    """
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return
    while not isinstance(optimizer, DeepSpeedCPUAdam) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer  # accelerate's wrapper, then ZeRO's optimizer
    if not isinstance(optimizer, DeepSpeedCPUAdam) or not optimizer.state:
        return
    steps = max((int(state["step"]) for state in optimizer.state.values() if "step" in state), default=0)
    group = optimizer.param_groups[0]
    scratch = [torch.zeros(1) for _ in range(4)]  # weight, gradient and Adam's two moments
    for step in range(1, steps + 1):
        optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, group["lr"], *group["betas"], group["eps"],
                                          group["weight_decay"], group["bias_correction"], *scratch)


def check_deepspeed_config(config: dict, place: str) -> None:
    """Refuse now what DeepSpeed would refuse when its engine starts: a key it does not know or a value it does
    not take in a section it models (zero_optimization, fp16, bf16, ...), e.g. "stage": 4 or "stagee".

    DeepSpeed's own parsing of every section does the checking, with the "auto" values that accelerate fills
    in at prepare() left out as DeepSpeed leaves them out.
    """
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    # DeepSpeedConfig's __init__ parses the sections (its private _initialize_params), then does batch-size
    # arithmetic that needs the process group and the values accelerate has not filled in yet: only the first
    # part runs here (test_oneline's DeepSpeed JSON tests fail if it changes).
    parsed = object.__new__(DeepSpeedConfig)
    try:
        parsed._initialize_params(copy.deepcopy(config))
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(map(str, first["loc"]))
        got = f" (got {json.dumps(first['input'], default=str)})" if first["type"] != "extra_forbidden" else ""
        raise InputError(f"{place}: DeepSpeed refuses it: {e.title} {key}: {first['msg']}{got}") from None
    except (ValueError, TypeError, AssertionError, KeyError) as e:
        raise InputError(f"{place}: DeepSpeed refuses it: {(str(e).splitlines() or [type(e).__name__])[0]}") from None


def describe(accelerator: Accelerator, cfg: TrainConfig) -> dict:
    """What ran: strategy, scale, precision and versions; logged at start and saved in run.json."""
    micro = cfg.per_device_train_batch_size
    plugin = accelerator.state.deepspeed_plugin
    return {
        "distributed_type": str(accelerator.distributed_type.value),
        "num_processes": accelerator.num_processes,
        "num_machines": int(os.environ.get("ACCELERATE_NUM_MACHINES", os.environ.get("GROUP_WORLD_SIZE", 1))),
        "mixed_precision": accelerator.mixed_precision,
        "zero_stage": plugin.zero_stage if plugin else None,
        "zero_offload": zero_offload(plugin.deepspeed_config.get("zero_optimization", {})) if plugin else None,
        "device": str(accelerator.device),
        "micro_batch_size": micro,
        "global_batch_size": micro * cfg.gradient_accumulation_steps * accelerator.num_processes,
        "versions": {"python": platform.python_version(), **{name: installed_version(name) for name in
                     ("torch", "accelerate", "transformers", "datasets", "deepspeed")}},
    }


def installed_version(package: str):
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def exit_finished_run() -> None:
    """End the process of a finished distributed run (after `accelerator.end_training()`) without
    interpreter teardown; a single process exits normally.

    `end_training` destroys the process groups, but references to them survive it: DeepSpeed's
    engine and optimizer, `_dp_group` on every parameter, `deepspeed.utils.groups`, and even in DDP
    runs `group=WORLD` defaults bound when deepspeed.comm is imported. So gloo's C++ threads are
    still running while the interpreter tears down, and one that touches Python then aborts the
    finished run ("terminate called without an active exception", SIGABRT: `accelerate launch`
    returns 1). Every file of the run is closed and every tracker finished by now: only the
    teardown is skipped.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        exit_now(0)


# DeepSpeed's C++ ops that launches compile at first use, by the names DeepSpeed's accelerator knows their
# builders, and about how many seconds compiling takes on a 2-core CPU (said when a launch compiles one).
COMPILE_SECONDS = {"ShareMemCommBuilder": 45, "CPUAdamBuilder": 60}
# File systems that other machines may share: a build lock there may belong to a build on another machine.
SHARED_FILE_SYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                       "fuse.sshfs", "9p", "afs", "panfs", "wekafs"}


def load_deepspeed_ops(names: list[str]) -> dict[str, float]:
    """Load (compiling at first use) DeepSpeed ops by builder name, saying so: {op: seconds it took}.

    DeepSpeed compiles with torch's cpp_extension into its cache (~/.cache/torch_extensions, or
    $TORCH_EXTENSIONS_DIR), silently, under a lock file that a killed build leaves behind and that
    every later build waits on for ever. So the local main process clears a stale lock first (or
    says why it waits), says when it compiles and how long it took, and builds while the other local
    ranks wait for the result; a SIGTERM during the build ends it as an exception, so that torch
    releases its lock.
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    # Where torch's load() builds, and so holds its lock: private, with no public counterpart (test_faults
    # fails if it changes).
    from torch.utils.cpp_extension import _get_build_directory

    local_main = int(os.environ.get("LOCAL_RANK", "0")) == 0
    seconds = {}
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            continue  # DeepSpeed does without it on this machine
        build_dir = _get_build_directory(builder.name, verbose=False)
        library = os.path.join(build_dir, f"{builder.name}.so")
        compiling = not installed_ops.get(builder.name) and not os.path.exists(library)
        if local_main:
            release_stale_build_lock(build_dir)
            if compiling:
                print(f"compiling DeepSpeed's {builder.name} op for this machine (first use only; it took "
                      f"{COMPILE_SECONDS[name]} s on a 2-core CPU; later launches load it from {build_dir})",
                      flush=True)
        elif compiling:
            while not os.path.exists(library):  # the local main process builds it; the launcher stops us if it fails
                time.sleep(0.5)
        start = time.perf_counter()
        with sigterm_raises():
            builder.load(verbose=False)
        seconds[builder.name] = time.perf_counter() - start
        if compiling and local_main:
            print(f"compiled {builder.name} in {seconds[builder.name]:.0f} s", flush=True)
    return seconds


@contextmanager
def sigterm_raises():
    """SIGTERM as SystemExit (exit code 143) meanwhile, so that `finally` blocks run (torch's build releases
    its lock file in one) instead of the process vanishing."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def release_stale_build_lock(build_dir: str) -> None:
    """Remove the `lock` a killed build left in a torch extension's build folder, when provably stale.

    While torch builds, the process that took the lock (its FileBaton) keeps it open: a lock that no
    process on this machine holds open was left by a build that died. Compilers it started may still
    work in the folder (a rank killed outright leaves them running): those are waited for. Then, a
    second later and still unheld, the lock is removed, unless the folder is on a file system other
    machines may share, where a build elsewhere could hold it: that is only reported, with what to do.
    """
    lock = os.path.join(build_dir, "lock")

    def processes(test) -> list[str]:
        found = []
        for process in psutil.process_iter(["name"]):
            try:
                if test(process):
                    found.append(f"pid {process.pid} ({process.info['name']})")
            except (psutil.Error, OSError):
                continue  # gone, or another user's: it cannot build in this user's cache
        return found

    def holding():
        return processes(lambda p: any(f.path == lock for f in p.open_files()))

    def working():
        return processes(lambda p: os.path.join(p.cwd(), "").startswith(os.path.join(build_dir, "")))

    def identity():
        try:
            stat = os.stat(lock)
            return stat.st_ino, stat.st_mtime_ns
        except FileNotFoundError:
            return None

    first = identity()
    if first is None:
        return
    if holding():
        print(f"waiting for {', '.join(holding())}, compiling in {build_dir}", flush=True)
        return
    if working():
        print(f"waiting for {', '.join(working())}, left compiling in {build_dir} by a build that was killed",
              flush=True)
        while working():
            time.sleep(1)
    file_system = file_system_type(build_dir)
    if file_system in SHARED_FILE_SYSTEMS or file_system.startswith("fuse."):
        print(f"warning: waiting for {lock}: no process on this machine is compiling there, and another machine "
              f"sharing this file system ({file_system}) may be. If none is, a killed build left it: stop this "
              f"launch, delete it (rm {lock}) and launch again", file=sys.stderr, flush=True)
        return
    time.sleep(1)
    if identity() != first or holding() or working():
        return
    os.remove(lock)
    print(f"removed {lock}: a build that no longer runs left it (this launch would have waited on it for ever)",
          flush=True)


def file_system_type(path: str) -> str:
    path = os.path.realpath(path)
    mounts = [p for p in psutil.disk_partitions(all=True) if path == p.mountpoint or
              path.startswith(os.path.join(p.mountpoint, ""))]
    return max(mounts, key=lambda p: len(p.mountpoint)).fstype if mounts else ""
