"""Train a small CNN with nn.DataParallel (all visible GPUs; on CPU it wraps and runs).

    python examples/data_parallel.py                  # digits, Ray workers
    python examples/data_parallel.py --torch-loader   # the same with torch's workers
    python examples/data_parallel.py --data DIR --epochs 40   # FashionMNIST IDX files
"""

import os
import sys

import cloudpickle
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from dpex import DpexDataLoader  # noqa: E402

cloudpickle.register_pickle_by_value(common)  # Ray workers cannot import this folder


def main() -> None:
    args = common.example_args(__doc__.splitlines()[0]).parse_args()
    torch.manual_seed(0)
    device = common.pick_device()
    data = common.load_images(args.data)
    train = common.ImageSet(*data["train"], shift=1)
    loader = DpexDataLoader(
        train, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0, pin_memory=device.type == "cuda",
        distribute_mode=not args.torch_loader, head_address=args.head_address,
        ray_remote_args={"num_cpus": args.worker_cpus},
    )
    # The seed README's pattern: wrap when there are several GPUs. DataParallel on CPU or
    # one GPU runs the module as is, so it is wrapped always here.
    model = nn.DataParallel(common.SmallCNN().to(device))
    mode = "torch workers" if args.torch_loader else "dpex Ray workers"
    n_dev = max(1, torch.cuda.device_count())
    print(f"DataParallel over {n_dev} {device.type} device(s), {len(train)} training images, "
          f"{mode}", flush=True)
    with loader:
        loss = common.train_epochs(model, loader, data, args, device,
                                   log=lambda line: print(line, flush=True))
    print(f"final loss {loss:.4f}")


if __name__ == "__main__":
    main()
