"""Batches (textclf/data/batches.py): the epoch's order from the seed and the epoch alone, whole global batches, the
same micro-batches on any number of processes, a batch without padding."""

import random

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler

from benchmarks.measure import epoch_padding
from textclf.config import TrainConfig
from textclf.data.batches import EpochLengthGroupedSampler, micro_batch_seed

# A long tail, as in real reviews: most texts short, a few up to max_length.
LENGTHS = [min(128, int(random.Random(i).paretovariate(1.2) * 8)) for i in range(1000)]


def order(seed: int, epoch: int, batch_size: int = 32, group_by_length: bool = True) -> list[int]:
    sampler = EpochLengthGroupedSampler(LENGTHS, batch_size, seed, group_by_length)
    sampler.set_epoch(epoch)
    return list(sampler)


def micro_batches(per_process: int, processes: int, accumulation: int, group_by_length: bool) -> dict:
    """{(optimizer step, the micro-batch's seed): its examples} over one epoch, dealt out as
    `accelerator.prepare` deals them, each micro-batch seeded as train.py seeds it."""
    sampler = EpochLengthGroupedSampler(LENGTHS, per_process * processes * accumulation, 42, group_by_length)
    batches = BatchSampler(sampler, per_process, drop_last=False)
    found = {}
    for rank in range(processes):
        shard = list(BatchSamplerShard(batches, num_processes=processes, process_index=rank))
        for i, batch in enumerate(shard):
            step, micro = divmod(i, accumulation)
            found[(step, micro_batch_seed(42, step, micro * processes + rank))] = sorted(batch)
    return found


@pytest.mark.parametrize("group_by_length", [True, False])
def test_order_is_whole_global_batches_fixed_by_seed_and_epoch_alone(group_by_length):
    first = order(seed=42, epoch=0, group_by_length=group_by_length)
    # 1000 examples fill 31 global batches of 32: 8 sit out the epoch, a different 8 each epoch.
    assert len(first) == len(set(first)) == 31 * 32 and set(first) <= set(range(len(LENGTHS)))
    assert order(seed=42, epoch=0, group_by_length=group_by_length) == first  # a resumed run draws the same
    second = order(seed=42, epoch=1, group_by_length=group_by_length)
    assert second != first and len(set(second)) == 31 * 32 and set(second) != set(first)
    assert order(seed=43, epoch=0, group_by_length=group_by_length) != first


def test_data_smaller_than_one_global_batch_is_one_step_of_it_repeated():
    sampler = EpochLengthGroupedSampler(LENGTHS[:20], 32, seed=42)
    assert len(list(sampler)) == 32 and set(sampler) == set(range(20))


def test_first_batch_holds_the_longest_example():
    for epoch in range(3):
        assert max(LENGTHS) == max(LENGTHS[i] for i in order(seed=42, epoch=epoch)[:32])


def test_two_processes_split_one_length_group_per_step():
    per_process = 16
    sampler = EpochLengthGroupedSampler(LENGTHS, 2 * per_process, seed=42)
    groups = list(sampler)
    groups = [groups[i:i + 2 * per_process] for i in range(0, len(groups), 2 * per_process)]
    # What `accelerator.prepare` does to the DataLoader's batches with 2 processes.
    batches = BatchSampler(sampler, per_process, drop_last=False)
    shards = [list(BatchSamplerShard(batches, num_processes=2, process_index=rank)) for rank in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == len(groups)  # whole groups: no rank is padded
    for step, (rank0, rank1) in enumerate(zip(*shards)):
        assert sorted(rank0 + rank1) == sorted(groups[step]), step
        assert not set(rank0) & set(rank1)
    # Padded lengths: similar lengths share a batch on every rank (LENGTHS in file order are random).
    grouped = sum(max(LENGTHS[i] for i in batch) for shard in shards for batch in shard)
    in_file_order = BatchSampler(range(len(LENGTHS)), per_process, drop_last=False)
    random_batches = sum(max(LENGTHS[i] for i in batch) for batch in in_file_order)
    assert grouped < 0.6 * random_batches


@pytest.mark.parametrize("group_by_length", [True, False])
def test_more_processes_and_less_accumulation_run_the_same_micro_batches_with_the_same_seeds(group_by_length):
    one = micro_batches(8, processes=1, accumulation=4, group_by_length=group_by_length)
    assert len(one) == 31 * 4  # every micro-batch of the epoch, each with a seed of its own
    for processes, accumulation in [(2, 2), (4, 1)]:
        assert micro_batches(8, processes, accumulation, group_by_length) == one, (processes, accumulation)


@pytest.mark.slow
def test_an_epoch_of_real_reviews_is_at_least_95_percent_real_tokens(corpus_csv, tmp_path):
    padding = epoch_padding(TrainConfig(data=str(corpus_csv), cache_dir=str(tmp_path)))
    fraction = padding["real_token_fraction"]
    assert fraction["train.py"] >= 0.95, fraction
    assert fraction["random"] < 0.5, fraction  # what grouping saves on this data
    assert abs(fraction["train.py"] - fraction["hf_trainer"]) < 0.01, fraction  # the same groups, shuffled


def test_a_batch_without_padding_goes_without_an_attention_mask_and_computes_the_same(tiny_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from textclf.data.batches import Collator

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model).eval()
    collate = Collator(tokenizer)
    full = [{"input_ids": [2, 5, 6, 7, 3]}, {"input_ids": [2, 8, 9, 10, 3]}]
    batch = collate(full)
    assert "attention_mask" not in batch
    with torch.no_grad():
        masked = model(**batch, attention_mask=torch.ones_like(batch["input_ids"])).logits
        assert torch.equal(model(**batch).logits, masked)
    padded = collate([full[0], {"input_ids": [2, 8, 3]}])
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
