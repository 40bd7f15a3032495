"""The check command's memory report: per rank, the model states, what DDP or DeepSpeed add, the activations and, on a
CPU, the process itself, from the estimates (estimates.py), written as the report's lines.
"""

from textclf.config import TrainConfig

from .estimates import (
    BYTES_PER_PARAM,
    FRAMEWORK_BASELINE_BYTES,
    SHARDED_FROM_STAGE,
    activation_bytes,
    framework_buffer_bytes,
    model_state_bytes,
)


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"


def human(n_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n_bytes < 1024 or unit == "GiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024


def memory_report(cfg: TrainConfig, config, params: int, trainable: int, offloaded: list[str], *, kind: str,
                  world: int, stage: int, zero: dict, precision: str, on_gpu: bool) -> list[tuple[str, str]]:
    """The report's lines for the memory one rank needs: its model states as the ZeRO paper counts them (sharded
    from their stage on, the parts `offloaded` held in CPU memory), then the peak (predicted_peak)."""
    sixteen_bit = kind == "DEEPSPEED" and precision != "no"  # torch autocast keeps fp32 weights and states
    loaded = cfg.torch_dtype if cfg.torch_dtype != "auto" else str(getattr(config, "dtype", None) or "float32")
    layout = ("16-bit" if sixteen_bit else
              "16-bit weights" if loaded.removeprefix("torch.") in ("bfloat16", "float16") else "fp32")
    memory = model_state_bytes(params, trainable, world=world, stage=stage, layout=layout)
    sharded = [part for part in memory if stage >= SHARDED_FROM_STAGE[part]]
    return [("memory per rank", f"{human(sum(memory.values()))}: "
             + ", ".join(f"{part} {human(n)}" + (" (CPU)" if part in offloaded else "") for part, n in memory.items())),
            ("", f"{'+'.join(map(str, BYTES_PER_PARAM[layout]))} bytes per parameter "
                 f"({'the weights in ' + loaded if layout == '16-bit weights' else 'ZeRO paper'}); "
                 f"sharded over {plural(world, 'rank')}: {', '.join(sharded) or 'nothing'}"),
            *predicted_peak(cfg, config, memory, offloaded, kind=kind, world=world, stage=stage, zero=zero,
                            layout=layout, precision=precision, params=params, trainable=trainable, on_gpu=on_gpu)]


def predicted_peak(cfg: TrainConfig, config, states: dict, offloaded: list, *, kind: str, world: int, stage: int,
                   zero: dict, layout: str, precision: str, params: int, trainable: int,
                   on_gpu: bool) -> list[tuple[str, str]]:
    """The report's lines for the peak memory one rank will hold: model states, what DDP or DeepSpeed add
    (framework_buffer_bytes), activations, and on a CPU the process itself."""
    buffers = framework_buffer_bytes(
        params, trainable, world=world, stage=stage, layout=layout,
        strategy={"MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "DEEPSPEED": "deepspeed"}.get(kind, kind),
        live_parameters=zero.get("stage3_max_live_parameters", 1e9) if kind == "DEEPSPEED" else 0)
    activations = activation_bytes(
        layers=config.num_hidden_layers, hidden=config.hidden_size, heads=config.num_attention_heads,
        micro_batch=cfg.per_device_train_batch_size, sequence=cfg.max_length,
        bytes_per_value=2 if precision != "no" or layout != "fp32" else 4,
        checkpointing=cfg.gradient_checkpointing)
    # Offloaded states leave a GPU (the optimizer's fp32 buffers with its states); on a CPU they stay.
    held = sum(n for part, n in states.items() if not (on_gpu and part in offloaded))
    if on_gpu and "optimizer states" in offloaded:
        buffers = {part: n for part, n in buffers.items() if not part.startswith("fp32 ")}
    parts = {"model states": held, **buffers, "activations": activations}
    if not on_gpu:
        parts["the process"] = FRAMEWORK_BASELINE_BYTES
    where = ("of GPU memory (the CUDA context and the allocator's cache not counted)" if on_gpu else
             "of memory (resident, as measured on this CPU machine)")
    return [("peak per rank", f"{sum(parts.values()) / 2 ** 30:.2f} GiB {where}"),
            ("", " + ".join(f"{part} {human(n)}" for part, n in parts.items())
                 + f"; activations at most: {cfg.per_device_train_batch_size} x {cfg.max_length} tokens"
                 + (", checkpointed" if cfg.gradient_checkpointing else ""))]
