"""Length-grouped training batches: a pure function of (seed, epoch), one whole length group per
optimizer step across processes, and little padding on real review data."""

import random

import pytest
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler

from benchmarks.measure import epoch_padding
from textclf.config import TrainConfig
from textclf.data import EpochLengthGroupedSampler

# A long tail, as in real reviews: most texts short, a few up to max_length.
LENGTHS = [min(128, int(random.Random(i).paretovariate(1.2) * 8)) for i in range(1000)]


def order(seed: int, epoch: int, batch_size: int = 32) -> list[int]:
    sampler = EpochLengthGroupedSampler(LENGTHS, batch_size, seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_order_is_a_permutation_fixed_by_seed_and_epoch_alone():
    first = order(seed=42, epoch=0)
    assert sorted(first) == list(range(len(LENGTHS)))
    assert order(seed=42, epoch=0) == first  # a fresh sampler (a resumed run) draws the same epoch
    assert order(seed=42, epoch=1) != first and sorted(order(seed=42, epoch=1)) == sorted(first)
    assert order(seed=43, epoch=0) != first


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
    full_groups = len(LENGTHS) // (2 * per_process)
    for step, (rank0, rank1) in enumerate(zip(*shards)):
        if step < full_groups:
            assert sorted(rank0 + rank1) == sorted(groups[step]), step
            assert not set(rank0) & set(rank1)
    # Padded lengths: similar lengths share a batch on every rank (LENGTHS in file order are random).
    grouped = sum(max(LENGTHS[i] for i in batch) for shard in shards for batch in shard)
    in_file_order = BatchSampler(range(len(LENGTHS)), per_process, drop_last=False)
    random_batches = sum(max(LENGTHS[i] for i in batch) for batch in in_file_order)
    assert grouped < 0.6 * random_batches


@pytest.mark.slow
def test_an_epoch_of_real_reviews_is_at_least_95_percent_real_tokens(corpus_csv, tmp_path):
    padding = epoch_padding(TrainConfig(data=str(corpus_csv), cache_dir=str(tmp_path)))
    fraction = padding["real_token_fraction"]
    assert fraction["train.py"] >= 0.95, fraction
    assert fraction["random"] < 0.5, fraction  # what grouping saves on this data
    assert abs(fraction["train.py"] - fraction["hf_trainer"]) < 0.01, fraction  # the same groups, shuffled
