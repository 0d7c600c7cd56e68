"""One rank of a job that resumes on another number of ranks, run by
tests/test_reshard_torchrun.py under torchrun (gloo) as a user runs it.

    torchrun --nproc_per_node=R tests/reshard_app.py --out DIR [--resume STATE] [--no-full]

Every rank trains with the same DpexDataLoader (DistributedSampler, shuffled,
``worker_seeding="per_sample"``, one dpex worker) over a dataset whose items draw
an augmentation from torch's RNG:

- ``full`` (unless ``--no-full``): two uninterrupted epochs with persistent workers;
  after STOP_AT steps of epoch 0 each rank saves ``state_dict()``
  (``DIR/state_rank{r}.pt``, as a checkpoint holds it; the epoch goes on).
- with ``--resume STATE`` (rank 0's file of a job with another number of ranks):
  each rank loads that one state into a fresh loader (fresh workers, then again
  with persistent ones), runs the rest of epoch 0, then epoch 1.

Each rank writes ``DIR/rank{r}.pt``: per run and epoch, its batches as
(sample index, augmentation) pairs.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from dpex import DpexDataLoader

N, BATCH, STOP_AT, WORKERS = 45, 2, 3, 1


class Augmented(Dataset):
    """Item i: (i, two draws from torch's RNG): equal between two runs only if the
    sample was seeded the same."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor(i), torch.rand(2, dtype=torch.float64)


def loader(persistent: bool) -> DpexDataLoader:
    dataset = Augmented()
    return DpexDataLoader(dataset, batch_size=BATCH, num_workers=WORKERS,
                          sampler=DistributedSampler(dataset, shuffle=True, seed=11),
                          persistent_workers=persistent, distribute_mode=True,
                          worker_seeding="per_sample")


def pairs(batch) -> list[tuple[int, list[float]]]:
    indices, augmentation = batch
    return [(int(i), a.tolist()) for i, a in zip(indices, augmentation, strict=True)]


def run(data: DpexDataLoader, state_out: str | None = None) -> list[list]:
    epochs = []
    for epoch in range(2):
        data.sampler.set_epoch(epoch)
        batches = []
        for step, batch in enumerate(data):
            batches.append(pairs(batch))
            if state_out is not None and epoch == 0 and step + 1 == STOP_AT:
                torch.save(data.state_dict(), state_out)
        epochs.append(batches)
    data.close()
    return epochs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", help="rank 0's state of a job with other ranks")
    parser.add_argument("--no-full", action="store_true", help="only the resumed runs")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record = {"world_size": dist.get_world_size()}
    if not args.no_full:
        record["full"] = run(loader(persistent=True),
                             os.path.join(args.out, f"state_rank{rank}.pt"))
    if args.resume:
        state = torch.load(args.resume, weights_only=True)  # as Lightning and Accelerate load
        for persistent in (False, True):
            data = loader(persistent)
            data.sampler.set_epoch(0)
            data.load_state_dict(state)
            record[f"resumed_{'persistent' if persistent else 'fresh'}"] = run(data)
    torch.save(record, os.path.join(args.out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
