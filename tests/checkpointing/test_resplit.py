"""A checkpoint on another number of processes (textclf/checkpointing/resplit.py): the global batch kept, or the numbers
of processes that can."""

import pytest

from textclf.errors import InputError

RUN = {"world_size": 1, "zero_stage": None, "mixed_precision": "no"}  # the launch, as check_against takes it


def test_a_resume_on_another_number_of_processes_keeps_the_global_batch_or_names_the_ones_that_can():
    from textclf.checkpointing.resplit import batch_split, on_this_launch
    from textclf.checkpointing.resume_rules import check_against

    made = {"world_size": 2, "gradient_accumulation_steps": 3, "per_device_train_batch_size": 8,
            "global_batch_size": 48, "zero_stage": None, "mixed_precision": "no"}

    def split(world_size, position=made):
        found = batch_split("ck", position, world_size)
        return found["per_device_train_batch_size"], found["gradient_accumulation_steps"]

    # Down and up: the accumulation changes while it can, then the micro-batch.
    assert [split(n) for n in (1, 3, 6, 12, 48)] == [(8, 6), (8, 2), (8, 1), (4, 1), (1, 1)]
    # The micro-batch a resume made smaller grows back to the one asked for (the checkpoint's config).
    assert split(1, {**made, "world_size": 12, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                     "config": {"per_device_train_batch_size": 8}}) == (8, 6)
    # Said with it: the run is no longer the uninterrupted one bit for bit (the README's claim says so too).
    assert check_against("ck", made, {**RUN, "world_size": 3}) == (
        "resuming ck, made by 2 processes with micro-batch 8 and gradient accumulation 3, on 3 processes: "
        "micro-batch 8 and gradient accumulation 2 keep its global batch of 48; the order gradients are summed in "
        "differs, so from here it matches the uninterrupted run to rounding, not bit for bit")
    assert check_against("ck", made, {**RUN, "world_size": 12}).endswith(
        "on 12 processes: micro-batch 4 and gradient accumulation 1 keep its global batch of 48; its dropout masks "
        "(micro-batches split) and the order gradients are summed in differ, so from here it matches the "
        "uninterrupted run closely, not bit for bit")
    with pytest.raises(InputError) as refused:
        split(5)
    assert str(refused.value) == (
        "cannot resume from ck on 5 processes: its global batch of 48 (2 processes x micro-batch 8 x accumulation 3) "
        "does not split into equal micro-batches over 5 processes; resume it on 1, 2, 3, 4, 6, 8, 12, 16, 24, 48 "
        "processes (accelerate launch --num_processes N ... train.py --resume ck)")
    with pytest.raises(InputError, match="made by an older textclf, whose data order depended on the number of "
                                         "processes"):
        split(2, {**made, "global_batch_size": None})
    # the position as the new launch counts it: batches per process into the epoch, the loss window split evenly
    window = {"loss_sum": 3.0, "losses": 6, "samples": 48, "real_tokens": 301, "padded_tokens": 400}
    moved = on_this_launch({**made, "batch_in_epoch": 9, "loss_window": [window, window]}, 3, 2, 8)
    assert moved["batch_in_epoch"] == 6
    assert moved["loss_window"] == [{"loss_sum": 2.0, "losses": 4, "samples": 32, "real_tokens": 200 + extra,
                                     "padded_tokens": 266 + 2 * (extra > 0)} for extra in (2, 0, 0)]
    # in micro-batches half as big: twice the losses, of the same mean
    moved = on_this_launch({**made, "batch_in_epoch": 9, "loss_window": [window, window]}, 12, 1, 4)
    assert moved["batch_in_epoch"] == 3
    assert [(w["loss_sum"], w["losses"], w["samples"]) for w in moved["loss_window"]] == [(1.0, 2, 8)] * 12
