"""What a launch needs, by theory: memory per rank for the model states (the ZeRO paper) and for activations, and
training FLOPs per token (Kaplan et al.; PaLM). The pre-launch check predicts with it and the benchmark measures
against it.
"""


# Bytes per parameter for weights, gradients and Adam's states (ZeRO paper, Rajbhandari et al. 2020,
# section 3.1): 16-bit weights and gradients with fp32 master weights, momentum and variance; or all fp32.
# Beside the paper, weights loaded in 16 bits (--torch_dtype) and trained by torch's AdamW, whose states
# take the weights' dtype.
BYTES_PER_PARAM = {"16-bit": (2, 2, 12), "fp32": (4, 4, 8), "16-bit weights": (2, 2, 4)}

# The ZeRO stage from which each part is sharded over the ranks (FSDP's full shard counts as stage 3).
SHARDED_FROM_STAGE = {"weights": 3, "gradients": 2, "optimizer states": 1}

# The parts DeepSpeed can offload, by the name of the setting that does it (offload_optimizer,
# offload_param; textclf.launch.zero_offload reads them).
OFFLOADED_BY = {"optimizer states": "optimizer", "weights": "param"}


def model_state_bytes(params: int, trainable: int, *, world: int, stage: int = 0,
                      sixteen_bit: bool = False, layout: str = "") -> dict[str, float]:
    """Bytes per rank of weights, gradients and optimizer states, each divided over the `world` ranks
    from the ZeRO stage that shards it. Frozen parameters (LoRA's base) have no gradients or states.

    Mixed precision under torch autocast keeps fp32 weights and states: only DeepSpeed's bf16/fp16
    modes hold 16-bit weights (`sixteen_bit`). `layout` names a row of BYTES_PER_PARAM instead.
    """
    weight, gradient, optimizer = BYTES_PER_PARAM[layout or ("16-bit" if sixteen_bit else "fp32")]
    totals = {"weights": params * weight, "gradients": trainable * gradient, "optimizer states": trainable * optimizer}
    return {part: total / (world if stage >= SHARDED_FROM_STAGE[part] else 1) for part, total in totals.items()}


def training_flops_per_token(non_embedding_params: int, trainable_non_embedding: int, layers: int, hidden: int,
                             tokens_per_sample: float) -> float:
    """Training FLOPs per real token: 6N plus attention (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022).

    N counts the parameters outside the embedding tables. Forward 2N, gradients of the activations
    2N, of the weights 2N for the weights that train (LoRA: the adapters and head only). Attention
    adds 12 x layers x hidden x sequence length, with the length of the average sample.
    """
    attention = 12 * layers * hidden * tokens_per_sample
    return 4 * non_embedding_params + 2 * trainable_non_embedding + attention


# Resident memory of a training process before its model: Python, torch, transformers, accelerate (and
# DeepSpeed), the data and the tokenizer. Measured per rank on this 2-core CPU machine, just before the
# model loads, under DDP and ZeRO-2/3 alike (benchmarks/decoder.py: 0.46 to 0.53 GiB).
FRAMEWORK_BASELINE_BYTES = 0.55e9


def framework_buffer_bytes(params: int, trainable: int, *, world: int, stage: int, layout: str, strategy: str,
                           live_parameters: float = 0) -> dict[str, float]:
    """Bytes per rank that DDP and DeepSpeed hold beyond the paper's model states (measured on a 0.5B decoder:
    benchmarks/decoder.py).

    DDP keeps its gradient buckets beside the gradients (a second copy, unless gradient_as_bucket_view).
    DeepSpeed's optimizer steps an fp32 partition of the weights with an fp32 gradient of its own, beside
    the gradient partition it reduces into (stage 1-2 `single_partition_of_fp32_groups`, stage 3
    `fp32_partitioned_groups_flat` and `grad_partitions_flat_buffer`); the fp32 weight copy is in the
    paper's 12 bytes for 16-bit training, not in its fp32 count. ZeRO-3 gathers whole parameters for the
    forward and backward passes and keeps up to `live_parameters` of them (stage3_max_live_parameters)
    gathered. `layout` is the row of BYTES_PER_PARAM the states follow; `strategy` is "ddp", "deepspeed"
    or anything else (one process, FSDP: nothing counted).
    """
    weight_bytes, gradient_bytes, _ = BYTES_PER_PARAM[layout]
    buffers = {}
    if strategy == "ddp" and world > 1:
        buffers["DDP gradient buckets"] = gradient_bytes * trainable
    if strategy != "deepspeed":
        return buffers
    if layout == "fp32":
        buffers["fp32 copy of the weight partition"] = 4 * trainable / world
    buffers["fp32 gradient of the partition"] = 4 * trainable / world
    if stage == 3:
        buffers["gathered weights"] = weight_bytes * min(params, live_parameters)
    return buffers


def activation_bytes(*, layers: int, hidden: int, heads: int, micro_batch: int, sequence: int, bytes_per_value: int,
                     checkpointing: bool) -> float:
    """Activations a rank keeps for the backward pass, at most (every text `sequence` tokens long).

    Per layer s*b*h*(34 + 5*a*s/h) bytes in 16-bit (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", section 4.1), scaled to the bytes per value. With
    checkpointing, each layer keeps its input and one layer at a time its full set.
    """
    tokens = micro_batch * sequence
    per_layer = tokens * hidden * (34 + 5 * heads * sequence / hidden) * bytes_per_value / 2
    if checkpointing:
        return layers * tokens * hidden * bytes_per_value + per_layer
    return layers * per_layer
