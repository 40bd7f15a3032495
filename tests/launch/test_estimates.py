"""Memory per rank by the ZeRO paper (textclf/launch/estimates.py)."""

from textclf.launch.estimates import model_state_bytes


def test_memory_estimate_follows_the_zero_paper():
    params = 1_000_000
    # DDP in fp32: 4 + 4 + 8 bytes per parameter, nothing sharded.
    assert model_state_bytes(params, params, world=8, stage=0, sixteen_bit=False) == {
        "weights": 4e6, "gradients": 4e6, "optimizer states": 8e6}
    # 16-bit weights: 2 + 2 + 12; stage 1 shards the optimizer, 2 also gradients, 3 also weights.
    assert model_state_bytes(params, params, world=4, stage=1, sixteen_bit=True) == {
        "weights": 2e6, "gradients": 2e6, "optimizer states": 3e6}
    assert model_state_bytes(params, params, world=4, stage=2, sixteen_bit=True) == {
        "weights": 2e6, "gradients": 0.5e6, "optimizer states": 3e6}
    assert model_state_bytes(params, params, world=4, stage=3, sixteen_bit=True) == {
        "weights": 0.5e6, "gradients": 0.5e6, "optimizer states": 3e6}
    # Frozen parameters (LoRA) have neither gradients nor optimizer states.
    assert model_state_bytes(params, 1000, world=1, stage=0, sixteen_bit=False)["optimizer states"] == 8000
