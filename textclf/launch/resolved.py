"""The launch `accelerate launch [flags] train.py` would start, resolved by accelerate's own code from its config file
(or the default one `accelerate config` wrote) and the flags the check takes: the launcher, the processes and
machines, the precision and where it comes from, the environment train.py's Accelerator reads, and the DeepSpeed
config its plugin would build. What that launch cannot run is the conflicts' business (checks.py).
"""

import argparse
import json
import logging
import os
import warnings
from contextlib import contextmanager
from typing import Optional

from textclf.errors import InputError

from .deepspeed_config import check_deepspeed_config
from .launcher import gpus_named

PRECISIONS = ("no", "fp16", "bf16")


def read_launch(args: argparse.Namespace) -> dict:
    """What `accelerate launch [these flags] train.py` would start, resolved by accelerate's own code.

    Its launch parser and validation merge the yaml (or the default config that `accelerate config`
    wrote) with the launch line; the launcher it then picks decides how many processes start (the
    simple launcher starts one, whatever num_processes says), and its environment is what train.py's
    Accelerator and DeepSpeedPlugin read.
    """
    import yaml
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    yaml_config = None
    if path is not None:  # one that --config_file names exists (parse_args)
        try:
            yaml_config = load_config_from_file(path)
        except (yaml.YAMLError, ValueError, AttributeError) as e:  # syntax; an unknown key or value; not a mapping
            raise InputError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
        if not isinstance(getattr(yaml_config.distributed_type, "value", yaml_config.distributed_type), str):
            raise InputError(f"{path}: distributed_type is {yaml_config.distributed_type!r}; quote it "
                             "(a bare NO is YAML for false)")
        if yaml_config.mixed_precision is not None and yaml_config.mixed_precision not in PRECISIONS:
            raise InputError(f"{path}: mixed_precision is {yaml_config.mixed_precision!r}, expected one of "
                             f"{', '.join(PRECISIONS)} (quote \"no\": a bare no is YAML for false)")
    line = [f"--{name}={value}" for name in ("config_file", "num_processes", "num_machines", "mixed_precision")
            if (value := getattr(args, name)) is not None] + (["--multi_gpu"] if args.multi_gpu else [])
    launch_args = launch_command_parser().parse_args([*line, "train.py"])
    gpu_ids = gpus_named(launch_args, yaml_config)  # read from the line as given, which the merge below completes
    asked_processes = launch_args.num_processes if launch_args.num_processes is not None else \
        getattr(yaml_config, "num_processes", None)
    with quiet_accelerate():
        try:  # accelerate's private merge of yaml and line, the one its launcher reads; test_check fails if it changes
            launch_args, _, precision_from_yaml = _validate_launch_command(launch_args)
        except ValueError as e:
            raise InputError(f"accelerate launch would refuse this launch: {str(e).splitlines()[0]}") from None
        launcher, env = launcher_and_environment(launch_args, precision_from_yaml)
    cuda = has_cuda(args.target)
    if launcher == "deepspeed":
        distributed_type = "DEEPSPEED"
    elif launcher == "torchrun":  # train.py forms a gloo group on the CPU where there is no CUDA
        distributed_type = "FSDP" if env.get("ACCELERATE_USE_FSDP") == "true" else "MULTI_GPU" if cuda else "MULTI_CPU"
    else:
        distributed_type = "MULTI_CPU" if launcher == "mpirun" else "NO"
    processes = 1 if launcher == "simple" else launch_args.num_processes
    if args.mixed_precision:
        source = "the launch line (--mixed_precision)"
    elif precision_from_yaml:
        source = f"{path} mixed_precision"
    else:
        source = "the default (no mixed_precision anywhere)"
    return {"path": path, "distributed_type": distributed_type, "yaml_distributed_type": yaml_distributed_type(path),
            "launcher": launcher, "num_processes": processes, "num_machines": launch_args.num_machines or 1,
            # Without a number on the line or in a yaml, accelerate takes the number of CUDA GPUs, 0 on a CPU, and
            # its simple launcher still starts one: what was asked for is what starts.
            "requested_processes": processes if asked_processes is None else asked_processes, "gpu_ids": gpu_ids,
            "mixed_precision": env["ACCELERATE_MIXED_PRECISION"], "precision_source": source,
            "precision_from_yaml": precision_from_yaml and not args.mixed_precision, "environment": env,
            "deepspeed_config_file": getattr(launch_args, "deepspeed_config_file", None),
            "fsdp_sharding_strategy": getattr(launch_args, "fsdp_sharding_strategy", None),
            "fsdp_offload_params": str(getattr(launch_args, "fsdp_offload_params", "false")).lower() == "true",
            "fsdp_auto_wrap_policy": getattr(launch_args, "fsdp_auto_wrap_policy", None),
            "fsdp_transformer_layer_cls_to_wrap": getattr(launch_args, "fsdp_transformer_layer_cls_to_wrap", None),
            "use_cpu": bool(getattr(launch_args, "use_cpu", False)), "main_process_ip": launch_args.main_process_ip,
            "dynamo_backend": str(launch_args.dynamo_backend or "no").upper()}


def yaml_distributed_type(path: Optional[str]) -> str:
    if path is None:
        return "NO"
    from accelerate.commands.config.config_args import load_config_from_file

    kind = load_config_from_file(path).distributed_type
    return str(getattr(kind, "value", kind))


@contextmanager
def quiet_accelerate():
    """accelerate's launch helpers warn about defaults and busy ports: noise for a check that launches nothing."""
    launch_logger = logging.getLogger("accelerate.commands.launch")
    level = launch_logger.level
    launch_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        launch_logger.setLevel(level)


def launcher_and_environment(launch_args: argparse.Namespace, precision_from_yaml: bool) -> tuple[str, dict]:
    """The launcher `accelerate launch` picks (the order of launch_command's branches) and the
    ACCELERATE_* environment it gives train.py."""
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    if launch_args.use_deepspeed and not launch_args.cpu:
        fields = [*launch_args.deepspeed_config, *(["mixed_precision"] if precision_from_yaml else [])] \
            if isinstance(getattr(launch_args, "deepspeed_config", None), dict) else []
        launch_args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        launcher, env = "deepspeed", prepare_deepspeed_cmd_env(launch_args)[1]
    elif (launch_args.use_fsdp or launch_args.use_megatron_lm or launch_args.multi_gpu) and not launch_args.cpu:
        launcher, env = "torchrun", prepare_multi_gpu_env(launch_args)
    else:
        launcher = "mpirun" if getattr(launch_args, "mpirun_hostfile", None) else "simple"
        env = prepare_simple_launcher_cmd_env(launch_args)[1]
    return launcher, {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


def read_deepspeed(launch: dict, conflicts: list[str]) -> tuple[Optional[dict], str]:
    """The DeepSpeed config train.py will run with, as accelerate's DeepSpeedPlugin builds it from the
    launch's environment: the json the yaml names, or the yaml's own deepspeed_config keys with
    accelerate's defaults. None when it cannot be built (a conflict says why)."""
    from accelerate.utils import DeepSpeedPlugin, patch_environment

    path = launch["deepspeed_config_file"]
    place = path or f"{launch['path']} deepspeed_config"
    if path and not os.path.isfile(path):
        conflicts.append(f"{launch['path']} names deepspeed_config_file {path}, which does not exist "
                         f"(relative paths start from the directory of the launch: {os.getcwd()})")
        return None, path
    # A mixed_precision key beside the json is reported by deepspeed_precision, naming both places.
    env = dict(launch["environment"])
    env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(
        field for field in env.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",") if field != "mixed_precision")
    try:
        with patch_environment(**env):
            config = DeepSpeedPlugin().deepspeed_config
    except json.JSONDecodeError as e:
        raise InputError(f"cannot read DeepSpeed config {path}: {e}") from None
    except ValueError as e:
        conflicts.append(f"{launch['path']} with {place}: accelerate refuses it: {str(e).splitlines()[0]}")
        return None, place
    check_deepspeed_config(config, place)
    return config, place


def has_cuda(target: str) -> bool:
    """Whether the launch is for a machine with CUDA: this one if it has, or the one --target names."""
    import torch

    return target == "cuda" or (target == "here" and torch.cuda.is_available())
