"""One DDP rank (launched by torchrun in tests/test_training_modes.py).

Reads two epochs through DpexDataLoader with a DistributedSampler and writes
its batches, its iterator's session id and its workers' pids to --out.
"""

import argparse
import os
import sys

import cloudpickle
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsets  # noqa: E402

from dpex import DpexDataLoader  # noqa: E402

cloudpickle.register_pickle_by_value(dsets)

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--head", default="auto")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(100 + rank)
dataset = dsets.NoisySquares(45)
sampler = DistributedSampler(dataset, seed=3)
loader = DpexDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2,
                        distribute_mode=True, head_address=args.head)
result = {"epochs": [], "sessions": [], "pids": []}
for epoch in range(2):
    sampler.set_epoch(epoch)
    it = iter(loader)
    result["epochs"].append(list(it))
    result["sessions"].append(it._driver.session.session_id)
    # The processes that ran the dataset code (on a warm worker: its session's own).
    result["pids"].extend(info.get("session_pid", info["pid"]) for info in it._ready.values())
dist.barrier()
torch.save(result, os.path.join(args.out, f"rank{rank}.pt"))
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
