"""PyTorch Lightning with dpex: the DataModule returns DpexDataLoaders; nothing else changes.

    python examples/lightning_example.py                                # one device
    python examples/lightning_example.py --devices 2 --strategy ddp     # 2 processes

Lightning re-creates the loaders as it needs (a DistributedSampler under DDP, its own
batch sampler for predict) and they stay DpexDataLoaders with dpex's Ray workers;
``seed_everything(..., workers=True)`` seeds those workers as it seeds torch's.
"""

import argparse

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import Dataset

from dpex import DpexDataLoader


class Noisy(Dataset):
    """A CPU-bound stand-in: a random augmentation of each item, made in the workers."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        x = torch.tensor([i / 256, (i % 7) / 7]) + 0.01 * torch.randn(2)
        return x, torch.tensor(float(i % 3))


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x).squeeze(-1), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x).squeeze(-1), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        return DpexDataLoader(Noisy(), batch_size=32, shuffle=True, num_workers=2,
                              persistent_workers=True, distribute_mode=True)

    def val_dataloader(self):
        return DpexDataLoader(Noisy(), batch_size=64, num_workers=2, distribute_mode=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    pl.seed_everything(0, workers=True)
    trainer = pl.Trainer(accelerator="auto", devices=args.devices, strategy=args.strategy,
                         max_epochs=args.epochs, logger=False, enable_checkpointing=False)
    trainer.fit(Regressor(), datamodule=Data())
    print(f"final train loss {trainer.callback_metrics['train_loss']:.4f} "
          f"(loader: {type(trainer.train_dataloader).__name__}, "
          f"distribute_mode={trainer.train_dataloader.distribute_mode})")
