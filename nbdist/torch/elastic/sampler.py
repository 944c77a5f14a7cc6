"""ElasticSampler: each epoch's samples split over the ranks, resplit on every resize, none twice."""
from __future__ import annotations

import random

import torch.utils.data

from nbdist.common import rank, size


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ElasticSampler, without its padding: within an epoch no sample is skipped or
    repeated, also across resizes.

    The epoch's order (shuffled by seed + epoch, the same on every rank) is dealt round-robin
    over the ranks; after k batches of b samples on every rank, the first k*b*size samples of
    that order are done - record_batch() counts them, commit() saves the count, and after a
    resize the rest is dealt over the new world. Ranks may get one sample (so one batch) more
    than others at the end of an epoch: call hvd.join() after the loop, or size batches so
    they divide evenly (Horovod pads with repeated samples instead).

    Use: put it in the TorchState; call record_batch(i, batch_size) after each batch and
    set_epoch(e + 1) at the end of each epoch.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (call at the end of the previous one): nothing processed yet."""
        self.epoch = int(epoch)
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every rank finished one more batch of `batch_size` samples."""
        self.processed_num = min(len(self.dataset),
                                 self.processed_num + int(batch_size) * self.num_replicas)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Deal the epoch's unprocessed samples over the current world."""
        self.num_replicas, self.rank = size(), rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.indices = self.remaining_indices[self.rank::self.num_replicas]

    def __iter__(self):
        return iter(list(self.indices))

    def __len__(self) -> int:
        return len(self.indices)
