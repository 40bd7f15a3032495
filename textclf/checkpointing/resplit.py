"""A checkpoint on another number of processes: the micro-batch and accumulation that keep its global batch, its
loop position and loss windows counted in this launch's batches, and whether ZeRO's states go through DeepSpeed's
universal checkpoint. No torch: the plan runs before it is imported.
"""

from __future__ import annotations

from typing import Optional

from textclf.errors import InputError

# What a run stores of its loss window, per rank (the loss Window's state).
WINDOW_KEYS = {"loss_sum": (int, float), "losses": (int,), "samples": (int,), "real_tokens": (int,),
               "padded_tokens": (int,)}


def processes(n) -> str:
    return f"{n} process{'es' * (n != 1)}"


def batch_split(checkpoint: str, position: dict, world_size: int) -> dict:
    """The micro-batch and gradient accumulation that make up the checkpoint's global batch on `world_size`
    processes (per_device_train_batch_size, gradient_accumulation_steps): the micro-batch its run asked for with
    another accumulation where that divides, else the largest smaller micro-batch that does (on more processes
    than it has micro-batches). Refused in one line, with the numbers of processes that can, when none does. No
    torch: it runs before the launch's Accelerator is made, which takes the accumulation."""
    total, made = position.get("global_batch_size"), position.get("per_device_train_batch_size")
    if not (isinstance(total, int) and isinstance(made, int) and made > 0):
        raise InputError(f"cannot resume from {checkpoint}: it was made by an older textclf, whose data order "
                         "depended on the number of processes; resume it with the textclf that made it, or start "
                         "a new run")
    # The micro-batch asked for is in the checkpoint's config: a resume on more processes may have made it smaller.
    asked = (position.get("config") or {}).get("per_device_train_batch_size")
    asked = asked if isinstance(asked, int) and asked > 0 else made
    micro = next((size for size in range(min(asked, total // world_size), 0, -1)
                  if total % (size * world_size) == 0), None)
    if micro is None:
        fits = [n for n in range(1, total + 1) if total % n == 0]
        raise InputError(f"cannot resume from {checkpoint} on {processes(world_size)}: its global batch of {total} "
                         f"({processes(position.get('world_size'))} x micro-batch {made} x accumulation "
                         f"{position.get('gradient_accumulation_steps')}) does not split into equal micro-batches "
                         f"over {processes(world_size)}; resume it on {', '.join(map(str, fits))} processes "
                         f"(accelerate launch --num_processes N ... train.py --resume {checkpoint})")
    return {"per_device_train_batch_size": micro, "gradient_accumulation_steps": total // (micro * world_size)}


def on_this_launch(position: dict, world_size: int, gradient_accumulation_steps: int,
                   micro_batch: Optional[int] = None) -> dict:
    """The position as this launch counts it: batches per process into the epoch, and the loss window split
    evenly over this launch's processes in micro-batches of `micro_batch` (by default the checkpoint's): a
    checkpoint sits where gradients sync, so all of them divide exactly."""
    made_on, made_with = position.get("world_size"), position.get("gradient_accumulation_steps")
    made_micro = position.get("per_device_train_batch_size")
    micro_batch = micro_batch or made_micro
    if made_on == world_size and micro_batch == made_micro:
        return position
    windows = position.get("loss_window")
    if isinstance(windows, list) and all(isinstance(w, dict) for w in windows) and \
            all(type(w.get(key)) in types for w in windows for key, types in WINDOW_KEYS.items()) and \
            isinstance(made_micro, int) and made_micro > 0:
        totals = {key: sum(w[key] for w in windows) for key in WINDOW_KEYS}
        # A loss is one micro-batch's mean: a micro-batch split in two is two losses of the same mean.
        totals |= {"loss_sum": totals["loss_sum"] * made_micro / micro_batch,
                   "losses": totals["losses"] * made_micro // micro_batch}
        windows = [{"loss_sum": totals["loss_sum"] / world_size, "losses": totals["losses"] // world_size,
                    **{key: totals[key] // world_size + (totals[key] % world_size if rank == 0 else 0)
                       for key in ("samples", "real_tokens", "padded_tokens")}} for rank in range(world_size)]
    batch = position.get("batch_in_epoch")
    if type(batch) is int and isinstance(made_with, int) and made_with > 0:
        batch = batch // made_with * gradient_accumulation_steps
    return {**position, "batch_in_epoch": batch, "loss_window": windows}


def needs_universal(checkpoint: str, position: dict, world_size: int, load_best_model_at_end: bool) -> bool:
    """Whether resuming this checkpoint on world_size processes goes through DeepSpeed's universal checkpoint:
    ZeRO partitions its optimizer state (and, at stage 3, the weights) over the processes that saved it.
    The best model's reload at the end loads checkpoints of both sizes into one engine, which is not offered."""
    universal = position.get("zero_stage") is not None and position.get("world_size") != world_size
    if universal and load_best_model_at_end:
        raise InputError(f"cannot resume {checkpoint} on {processes(world_size)} with --load_best_model_at_end: its "
                         f"ZeRO states were saved by {processes(position.get('world_size'))}, and the best model's "
                         "reload would mix checkpoints of both; resume it on as many processes as made it, or with "
                         "--load_best_model_at_end false")
    return universal
