"""The theory that the pre-launch check predicts with and the benchmark measures against: memory per
rank for the model states (the ZeRO paper) and training FLOPs per token (Kaplan et al.; PaLM)."""

# Bytes per parameter for weights, gradients and Adam's states (ZeRO paper, Rajbhandari et al. 2020,
# section 3.1): 16-bit weights and gradients with fp32 master weights, momentum and variance; or all fp32.
BYTES_PER_PARAM = {"16-bit": (2, 2, 12), "fp32": (4, 4, 8)}
# The ZeRO stage from which each part is sharded over the ranks (FSDP's full shard counts as stage 3).
SHARDED_FROM_STAGE = {"weights": 3, "gradients": 2, "optimizer states": 1}
# The parts DeepSpeed can offload, by the name of the setting that does it (offload_optimizer,
# offload_param; textclf.runtime.zero_offload reads them).
OFFLOADED_BY = {"optimizer states": "optimizer", "weights": "param"}


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
