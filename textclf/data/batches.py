"""Batches: the length-grouped order of an epoch (from the seed and the epoch alone, so a resume on any number of
processes replays it), the collator, the training and evaluation loaders, and each micro-batch's dropout seed.
"""

import hashlib
import math
import warnings

import torch
from datasets import Dataset
from torch.utils.data import DataLoader, Sampler
from transformers import DataCollatorWithPadding
from transformers.trainer_pt_utils import get_length_grouped_indices


class EpochLengthGroupedSampler(Sampler):
    """An epoch's examples in whole global batches, drawn from (seed, epoch, global batch) alone, never from how
    the global batch is split (`accelerate.prepare` deals its micro-batches out to the processes in turn): a
    checkpoint resumes on another number of processes at the same example, and replays its batches. The examples
    left over (fewer than one global batch) sit out the epoch, a different draw each epoch.

    With `group_by_length`, each global batch is one of the Trainer's length groups, shuffled whole: the Trainer's
    order walks each megabatch from its longest group to its shortest, which sweeps the label mix back and forth
    where length goes with the label, and a scratch model stayed at chance for epochs. The group with the longest
    example stays first, so an out-of-memory batch shows at once. No library sampler orders groups this way.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int, group_by_length: bool = True):
        self.lengths, self.batch_size, self.seed, self.epoch = lengths, batch_size, seed, 0
        self.group_by_length = group_by_length

    def __len__(self) -> int:
        return max(len(self.lengths) // self.batch_size, 1) * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        drawn = torch.randperm(len(self.lengths), generator=generator).tolist()
        kept = (drawn * math.ceil(len(self) / len(drawn)))[:len(self)]
        if not self.group_by_length:
            return iter(kept)
        grouped = [kept[i] for i in get_length_grouped_indices([self.lengths[i] for i in kept], self.batch_size,
                                                               generator=generator)]
        groups = [grouped[i:i + self.batch_size] for i in range(0, len(grouped), self.batch_size)]
        rest = [groups[1 + i] for i in torch.randperm(len(groups) - 1, generator=generator).tolist()]
        return iter([i for group in groups[:1] + rest for i in group])


def micro_batch_seed(seed: int, step: int, micro_batch: int) -> int:
    """The RNG seed for one micro-batch's dropout, from its place in the run (optimizer step, and accumulation
    index x processes + rank): whichever rank runs it, and the whole of the RNG state a resume needs."""
    digest = hashlib.sha256(f"{seed}/{step}/{micro_batch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a generator takes up to 2**63 - 1


def seed_micro_batch(seed: int, step: int, micro_batch: int, device: torch.device) -> None:
    """Seed the CPU's generator and the GPU's one micro-batch draws from; torch.manual_seed would seed every
    device type torch knows of, at each micro-batch."""
    value = micro_batch_seed(seed, step, micro_batch)
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)  # the current device's generator


class Collator(DataCollatorWithPadding):
    """transformers' DataCollatorWithPadding, less the attention mask of a batch without padding: given one,
    transformers asks the device whether it masks anything (masking_utils, for SDPA's fastest kernels), a wait for
    the GPU in every forward. A model given no mask computes what it does with a mask of all ones."""

    def __call__(self, features):
        batch = super().__call__(features)
        lengths = {len(feature["input_ids"]) for feature in features}
        if len(lengths) == 1 and lengths.pop() == batch["input_ids"].shape[1]:  # no row was padded
            del batch["attention_mask"]
        return batch


def make_loaders(train: Dataset, held_out: Dataset, tokenizer, *, train_batch_size: int, eval_batch_size: int,
                 num_processes: int, group_by_length: bool, seed: int, gradient_accumulation_steps: int = 1,
                 pad_to_multiple_of=None, pin_memory: bool = False, num_workers: int = 0):
    """Training and evaluation DataLoaders, before `accelerator.prepare` shards them. Each owns its generator:
    otherwise every new iterator draws a seed from the global RNG. `pin_memory` (a GPU's): batches are copied
    from page-locked memory while the device works."""
    collate = Collator(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
    generator = torch.Generator().manual_seed(seed)
    lengths, train = train["length"][:], train.remove_columns(["length"])  # [:] reads the column once
    sampler = EpochLengthGroupedSampler(lengths, train_batch_size * num_processes * gradient_accumulation_steps,
                                        seed, group_by_length)
    train_loader = DataLoader(train, batch_size=train_batch_size, sampler=sampler, collate_fn=collate,
                              generator=generator, pin_memory=pin_memory, num_workers=num_workers)
    eval_loader = length_sorted_loader(held_out, tokenizer, eval_batch_size, pad_to_multiple_of, pin_memory,
                                       num_workers)
    return train_loader, eval_loader


def length_sorted_loader(table: Dataset, tokenizer, batch_size: int, pad_to_multiple_of=None,
                         pin_memory: bool = False, num_workers: int = 0) -> DataLoader:
    """Batches of a tokenized table, longest first (little padding; a batch too big for memory fails at once),
    for evaluation and prediction: keep an index column to put results back in input order."""
    with warnings.catch_warnings():  # pyarrow's deprecation inside `datasets`, not ours to fix
        warnings.simplefilter("ignore", FutureWarning)
        table = table.sort("length", reverse=True).remove_columns(["length"])
    collate = Collator(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
    # Its own generator: iterating must not draw from the global RNG (dropout masks, exact resume).
    return DataLoader(table, batch_size=batch_size, collate_fn=collate, generator=torch.Generator(),
                      pin_memory=pin_memory, num_workers=num_workers)
