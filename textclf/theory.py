"""The theory that the pre-launch check predicts with and the benchmark measures against: memory per
rank for the model states (the ZeRO paper) and training FLOPs per token (Kaplan et al.; PaLM)."""

# Bytes per parameter for weights, gradients and Adam's states (ZeRO paper, Rajbhandari et al. 2020,
# section 3.1): 16-bit weights and gradients with fp32 master weights, momentum and variance; or all fp32.
BYTES_PER_PARAM = {"16-bit": (2, 2, 12), "fp32": (4, 4, 8)}
# The ZeRO stage from which each part is sharded over the ranks (FSDP's full shard counts as stage 3).
SHARDED_FROM_STAGE = {"weights": 3, "gradients": 2, "optimizer states": 1}


def model_state_bytes(params: int, trainable: int, *, world: int, stage: int = 0,
                      sixteen_bit: bool = False) -> dict[str, float]:
    """Bytes per rank of weights, gradients and optimizer states, each divided over the `world` ranks
    from the ZeRO stage that shards it. Frozen parameters (LoRA's base) have no gradients or states.

    Mixed precision under torch autocast keeps fp32 weights and states: only DeepSpeed's bf16/fp16
    modes hold 16-bit weights (`sixteen_bit`).
    """
    weight, gradient, optimizer = BYTES_PER_PARAM["16-bit" if sixteen_bit else "fp32"]
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


# Resident memory of a training process besides its model states, buffers and activations: Python, torch,
# transformers, accelerate (and DeepSpeed), the data and the tokenizer. Measured here, per rank, on the
# benchmark's scratch-mini rows (docs/benchmark.md: 1.0-1.2 GB, model states 55 MB of it).
FRAMEWORK_BASELINE_BYTES = {"torch": 1.0e9, "deepspeed": 1.1e9}


def framework_buffer_bytes(params: int, trainable: int, *, world: int, stage: int, sixteen_bit: bool, ddp: bool,
                           live_parameters: float = 0) -> dict[str, float]:
    """Bytes per rank that DDP and DeepSpeed hold beyond the paper's model states (measured on a 0.5B decoder:
    scripts/decoder_memory.py).

    DDP keeps its gradient buckets beside the gradients (a second fp32 copy, unless gradient_as_bucket_view).
    DeepSpeed's optimizer keeps its own fp32 copy of its weight partition even when the weights are fp32 (in
    16-bit the paper's 12 bytes include it). ZeRO-3 gathers whole parameters for the forward and backward
    passes and keeps up to `live_parameters` of them (stage3_max_live_parameters) gathered.
    """
    weight_bytes = BYTES_PER_PARAM["16-bit" if sixteen_bit else "fp32"][0]
    buffers = {}
    if ddp and world > 1:
        buffers["DDP gradient buckets"] = 4 * trainable
    if stage >= 1 and not sixteen_bit:
        buffers["fp32 copy of the weight partition"] = 4 * trainable / world
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
