"""A DeepSpeed launch's JSON (its yaml's deepspeed_config_file): read, refused before anything is built where it
contradicts the training config or DeepSpeed's own parser, and completed for the run.
"""

import copy
import json

from textclf.errors import InputError

from .deepspeed_ops import load_deepspeed_ops
from .launcher import launch_environment


def stage_and_precision(precision: str) -> tuple[int, str]:
    """this_launch under DeepSpeed: the ZeRO stage (the JSON's, or the launch's where it says "auto", as
    accelerate's DeepSpeedPlugin fills it in), and the precision, which a JSON switching a 16-bit type on decides."""
    ds_file = launch_environment().deepspeed_config_file
    ds_config = read_deepspeed_file(ds_file) if ds_file != "none" else {}
    stage = ds_config.get("zero_optimization", {}).get("stage", "auto")
    if stage == "auto":
        stage = launch_environment().deepspeed_zero_stage
    return stage, next((kind for kind in ("fp16", "bf16") if ds_config.get(kind, {}).get("enabled") is True),
                       precision)


def refuse_conflicts(cfg, world: int) -> None:
    """The first of deepspeed_conflicts in the launch's JSON, refused."""
    ds_file = launch_environment().deepspeed_config_file
    conflicts = deepspeed_conflicts(read_deepspeed_file(ds_file), ds_file, cfg, world) if ds_file != "none" else []
    if conflicts:
        raise InputError(conflicts[0])


def read_deepspeed_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise InputError(f"cannot read DeepSpeed config {path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read DeepSpeed config {path}: {e}") from None
    if not isinstance(config, dict):
        raise InputError(f"DeepSpeed config {path} is not a JSON object")
    return config


def deepspeed_conflicts(ds: dict, ds_place: str, cfg, world: int) -> list[str]:
    """What a DeepSpeed config sets that the training config owns: values not "auto" that disagree with it (accelerate
    would take DeepSpeed's accumulation with a warning, and the schedule would count another), and an optimizer
    or scheduler block."""
    conflicts = []
    micro, accumulation = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    owned = {
        "gradient_accumulation_steps": (accumulation, "--gradient_accumulation_steps"),
        "train_micro_batch_size_per_gpu": (micro, "--per_device_train_batch_size"),
        "train_batch_size": (micro * accumulation * world,
                             f"--per_device_train_batch_size x --gradient_accumulation_steps x {world} processes"),
        "gradient_clipping": (cfg.max_grad_norm, "--max_grad_norm"),
    }
    for key, (expected, flag) in owned.items():
        value = ds.get(key, "auto")
        if value != "auto" and value != expected:
            conflicts.append(f"{key}: {ds_place} hard-codes {value}, the training config has {expected} ({flag}); "
                             'set it to "auto" so that the training config decides')
    for block, made_by in (("optimizer", "AdamW"), ("scheduler", f"the {cfg.lr_scheduler_type} schedule")):
        if block in ds:
            conflicts.append(f'{ds_place} has a "{block}" block, but train.py builds {made_by} from the training '
                             "config: accelerate refuses both; remove the block")
    return conflicts


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


def before_the_accelerator(has_cuda: bool) -> None:
    """The JSON checked before anything is built (DeepSpeed itself reads it only at prepare()), and on a CPU the op
    deepspeed.comm loads when the Accelerator starts."""
    ds_file = launch_environment().deepspeed_config_file
    if ds_file != "none":
        check_deepspeed_config(read_deepspeed_file(ds_file), ds_file)
    if not has_cuda:
        load_deepspeed_ops(["ShareMemCommBuilder"])


def complete_the_plugin(plugin, max_grad_norm: float, load_universal: bool) -> None:
    """The training config's clipping where the JSON says "auto" (accelerate would fill in 1.0), the universal
    checkpoint's loading (a resume on another number of processes), and the op of DeepSpeedCPUAdam, which
    accelerate swaps in at prepare() when the optimizer is offloaded."""
    if plugin.deepspeed_config.get("gradient_clipping") == "auto":
        plugin.deepspeed_config["gradient_clipping"] = max_grad_norm
    if load_universal:
        plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    if zero_offload(plugin.deepspeed_config.get("zero_optimization", {}))["optimizer"] != "none":
        load_deepspeed_ops(["CPUAdamBuilder"])


def zero_offload(zero_optimization: dict) -> dict[str, str]:
    """Where DeepSpeed keeps optimizer states and parameters, from its `zero_optimization` section (run.json, the
    check and the benchmark read it here): {"optimizer": "cpu", "param": "none"}."""
    return {part: zero_optimization.get(f"offload_{part}", {}).get("device", "none") for part in ("optimizer", "param")}
