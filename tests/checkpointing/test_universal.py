"""A ZeRO checkpoint on another number of processes goes through DeepSpeed's universal checkpoint
(textclf/checkpointing/universal.py)."""

import pytest

from textclf.errors import InputError


def test_a_zero_checkpoint_on_another_number_of_processes_goes_through_the_universal_checkpoint():
    from textclf.checkpointing.resplit import needs_universal

    made = {"world_size": 2, "zero_stage": 3}
    assert needs_universal("ck", made, 1, False) and not needs_universal("ck", made, 2, True)
    assert not needs_universal("ck", {**made, "zero_stage": None}, 1, True)  # DDP: whole states
    with pytest.raises(InputError, match="cannot resume ck on 1 process with --load_best_model_at_end: its ZeRO "
                                         "states were saved by 2 processes"):
        needs_universal("ck", made, 1, True)
