"""Train a small CNN on one device (CUDA when available) with DpexDataLoader.

    python examples/single_device.py                  # digits, Ray workers
    python examples/single_device.py --torch-loader   # the same with torch's workers
    python examples/single_device.py --data DIR --epochs 40   # FashionMNIST IDX files
"""

import os
import sys

import cloudpickle
import torch

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
    model = common.SmallCNN().to(device)
    mode = "torch workers" if args.torch_loader else "dpex Ray workers"
    print(f"single device: {device}, {len(train)} training images, {mode}", flush=True)
    with loader:
        loss = common.train_epochs(model, loader, data, args, device,
                                   log=lambda line: print(line, flush=True))
    print(f"final loss {loss:.4f}")


if __name__ == "__main__":
    main()
