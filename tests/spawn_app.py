"""``mp.spawn(fn, args=(loader,))`` with a DpexDataLoader, run by tests/test_training_modes.py.

    python tests/spawn_app.py --out DIR

The loader travels to the ranks by pickling (after the parent iterated it, so it has
a live persistent iterator that must not travel). Rank 0 reads one batch and ends
early; rank 1 starts later (so rank 0 started its Ray first) and reads the whole
epoch slowly: it must not lose its workers or its Ray when rank 0 ends. Each rank
writes DIR/rank{R}.pt.
"""

import argparse
import os
import time

import torch
import torch.multiprocessing as mp
from torch.utils.data import Dataset


class Noisy(Dataset):
    """Defined in this script: under spawn the ranks know it as ``__mp_main__.Noisy``."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        return torch.tensor(i), torch.rand(())


def rank_main(rank: int, loader, out: str) -> None:
    import ray

    assert loader._iterator is None  # the configuration travelled, not the live iterator
    if rank == 1:
        time.sleep(3)  # rank 0 has started its Ray and is about to leave
    torch.manual_seed(5)  # the sampler and the workers' base seed draw from it, as in torch
    batches = []
    for batch in loader:
        batches.append(batch)
        if rank == 0:
            break
        time.sleep(0.3)  # still reading long after rank 0 has exited
    record = {"batches": batches, "gcs": ray.get_runtime_context().gcs_address}
    loader.close()
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))


def main() -> None:
    from dpex import DpexDataLoader

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    # No generator: a tensor (its state) passed through mp.spawn needs torch's "file_system"
    # sharing strategy on this machine, for torch's DataLoader as for any object.
    loader = DpexDataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2,
                            persistent_workers=True, distribute_mode=True)
    torch.manual_seed(5)
    first = list(loader)  # the parent's own epoch: a live persistent iterator now
    assert loader._iterator is not None
    mp.spawn(rank_main, args=(loader, args.out), nprocs=2)
    loader.close()
    torch.save({"batches": first}, os.path.join(args.out, "parent.pt"))


if __name__ == "__main__":
    main()
