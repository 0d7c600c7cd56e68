"""Train a small CNN with DistributedDataParallel: one DpexDataLoader stream per rank.

    torchrun --nproc_per_node=2 examples/ddp.py     # ranks launched by torchrun
    python examples/ddp.py --spawn 2                # or by torch.multiprocessing.spawn

NCCL on CUDA, gloo otherwise. Each rank reads its own shard through a
DistributedSampler (with set_epoch), and its batches come from its own Ray
workers to its own socket. All ranks join one Ray cluster: the one named by
--head-address / $RAY_ADDRESS, a running `ray start` cluster, or else a local
instance that the first rank to get there starts and the others join.
"""

import os
import socket
import sys

import cloudpickle
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from dpex import DpexDataLoader  # noqa: E402

cloudpickle.register_pickle_by_value(common)  # Ray workers cannot import this folder


def run(rank: int, world_size: int, args) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    torch.manual_seed(0)
    data = common.load_images(args.data)
    train = common.ImageSet(*data["train"], shift=1)
    sampler = DistributedSampler(train, seed=0)
    loader = DpexDataLoader(
        train, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0, pin_memory=cuda,
        distribute_mode=not args.torch_loader, head_address=args.head_address,
        ray_remote_args={"num_cpus": args.worker_cpus},
    )
    model = DistributedDataParallel(common.SmallCNN().to(device),
                                    device_ids=[local_rank] if cuda else None)
    if rank == 0:
        mode = "torch workers" if args.torch_loader else "dpex Ray workers"
        print(f"DDP: {world_size} ranks on {device.type} ({dist.get_backend()}), "
              f"{len(sampler)} images per rank, {mode}", flush=True)

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    with loader:
        loss = common.train_epochs(model, loader, data, args, device,
                                   before_epoch=sampler.set_epoch, log=log)
    print(f"rank {rank}: final loss {loss:.4f}", flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = common.example_args(__doc__.splitlines()[0])
    parser.add_argument("--spawn", type=int, default=0, metavar="N",
                        help="start N ranks with torch.multiprocessing.spawn (not torchrun)")
    parser.set_defaults(num_workers=1)
    args = parser.parse_args()
    if args.spawn:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        mp.spawn(run, args=(args.spawn, args), nprocs=args.spawn, join=True)
    else:
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
