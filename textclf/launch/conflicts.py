"""What a resolved launch (resolved.py) cannot run, each a conflict line of the check command naming both places:
the yaml's topology, DeepSpeed's ZeRO section and precision, and what the target machine lacks.
"""

import json

from .checks import cuda_only, float16_weights_conflict
from .deepspeed_config import zero_offload
from .launcher import fewer_processes
from .resolved import has_cuda


def check_topology(launch: dict, conflicts: list[str]) -> None:
    """The yaml mistakes that make `accelerate launch` start something other than what it says."""
    path, kind = launch["path"], launch["yaml_distributed_type"]
    processes, machines = launch["num_processes"], launch["num_machines"]
    if launch["requested_processes"] < 1:
        conflicts.append(f"{path or 'the launch line'}: num_processes {launch['requested_processes']}; a launch "
                         "needs at least 1 process (num_processes counts those of all machines together)")
    shortfall = fewer_processes(processes, launch["requested_processes"], kind, path)
    if shortfall:
        conflicts.append(shortfall)
    if processes % machines:
        conflicts.append(f"{path}: num_processes {processes} (all machines together) is not a multiple of "
                         f"num_machines {machines}")
    if machines > 1 and not launch["main_process_ip"]:
        conflicts.append(f"{path}: {machines} machines but no main_process_ip for them to meet at "
                         "(set it, or pass --main_process_ip)")
    if kind == "MULTI_GPU" and launch["use_cpu"]:
        conflicts.append(f"{path}: use_cpu true with MULTI_GPU starts {processes} independent single-process runs, "
                         "not one group; set use_cpu: false (train.py uses gloo where there is no CUDA)")


def deepspeed_precision(launch: dict, ds: dict, ds_place: str, precision: str, source: str,
                        conflicts: list[str]) -> str:
    """The precision DeepSpeed runs: its json wins where it is explicit, and a mismatch is a conflict."""
    if launch["deepspeed_config_file"] and launch["precision_from_yaml"]:
        conflicts.append(f"{launch['path']} sets mixed_precision {launch['mixed_precision']} next to "
                         f"deepspeed_config_file {ds_place}: accelerate refuses both; remove the key and pass "
                         "--mixed_precision on the launch line (the json's \"auto\" follows it)")
    explicit = {dtype: ds.get(dtype, {}).get("enabled", "auto") for dtype in ("fp16", "bf16")}
    explicit = {dtype: value for dtype, value in explicit.items() if value != "auto"}
    enabled = [dtype for dtype, value in explicit.items() if value is True]
    for dtype, value in explicit.items():
        if (value is True) != (precision == dtype):
            conflicts.append(f"precision: {source} is {precision}, but {ds_place} sets "
                             f'"{dtype}": {{"enabled": {json.dumps(value)}}}; '
                             'set it to "auto" so that the launch decides')
    return enabled[0] if len(enabled) == 1 else precision


def check_zero(zero: dict, ds_place: str, conflicts: list[str]) -> None:
    stage = zero.get("stage", 0)
    offload = zero_offload(zero)
    if offload["param"] != "none" and stage < 3:
        conflicts.append(f"offload: {ds_place} offloads parameters to {offload['param']} at ZeRO stage {stage}; "
                         "DeepSpeed offloads parameters only at stage 3 (use stage 3, or offload_optimizer alone)")
    if offload["optimizer"] != "none" and stage < 1:
        conflicts.append(f"offload: {ds_place} offloads the optimizer to {offload['optimizer']} at ZeRO stage 0; "
                         "DeepSpeed offloads the optimizer only at stages 1 to 3")
    if stage == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        conflicts.append(f"export: {ds_place} runs ZeRO-3 without \"stage3_gather_16bit_weights_on_model_save\": "
                         "true, so the export at the end of train.py (textclf/export.py) cannot gather full "
                         "weights; set it to true")


def check_machine(launch: dict, precision: str, source: str, target: str, torch_dtype: str,
                  conflicts: list[str], warnings: list[str]) -> None:
    """What the precision and the target machine cannot run: float16 weights under fp16's loss scaler, a GPU file
    (one naming gpu_ids), fp16 and FSDP without CUDA, bf16 without native bf16."""
    if conflict := float16_weights_conflict(precision, launch["distributed_type"], torch_dtype):
        conflicts.append(conflict)
    if has_cuda(target):
        return
    machine = "this machine" if target == "here" else "the target machine (--target cpu)"
    for need, fix in cuda_only(launch["distributed_type"], precision, launch["gpu_ids"]):  # train.py refuses the same
        where = f"precision ({source})" if need.startswith("mixed_precision") else launch["path"]
        conflicts.append(f"{where}: {need}, and {machine} has no CUDA GPU: train.py refuses it there; {fix}, or "
                         "--target cuda for a GPU machine")
    if precision == "bf16" and not cpu_has_native_bf16():
        warnings.append(f"precision: {source} is bf16, but this CPU has no native bf16 (avx512_bf16 or amx_bf16 "
                        "in /proc/cpuinfo): expect bf16 to run about 10x slower than fp32 here")


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            flags = {word for line in f if line.startswith("flags") for word in line.split()}
    except OSError:  # not Linux: no way to tell, and no reason to warn
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16"})
