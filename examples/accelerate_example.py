"""HF Accelerate with dpex: prepare the loader with dpex.accelerate.prepare_data_loader.

    python examples/accelerate_example.py                       # one process
    torchrun --nproc_per_node=2 examples/accelerate_example.py  # or accelerate launch

``accelerator.prepare(loader)`` would rebuild a DpexDataLoader as a plain torch
DataLoader (dpex warns if you do); ``prepare_data_loader`` keeps everything Accelerate
does (sharding per rank, device placement, gradient accumulation, gather_for_metrics)
and dpex's Ray workers.
"""

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import Dataset

from dpex import DpexDataLoader
from dpex.accelerate import prepare_data_loader


class Noisy(Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        x = torch.tensor([i / 256, (i % 7) / 7]) + 0.01 * torch.randn(2)
        return x, torch.tensor(float(i % 3))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = prepare_data_loader(accelerator, DpexDataLoader(
        Noisy(), batch_size=32, shuffle=True, num_workers=2, distribute_mode=True))
    for epoch in range(args.epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        accelerator.print(f"epoch {epoch + 1}: loss {loss.item():.4f}")
    accelerator.print(f"final loss {loss.item():.4f} "
                      f"(batches from a {type(loader.base_dataloader).__name__})")
