"""A PyTorch Lightning training script, run by tests/test_lightning.py as a user runs it.

    python tests/lightning_app.py --loader dpex|torch --scenario NAME --out DIR

The same script with ``--loader torch`` uses torch's DataLoader, so the test compares
what Lightning sees from each. Every rank writes ``DIR/rank{R}.pt``: the batches of
every training and validation step, the losses, the predictions, the loader classes
Lightning ended up with, and which raylet started the processes that made the items.

Scenarios:
- ``single``: ``Trainer.fit`` on one CPU device with a train and a val loader from a
  LightningDataModule (fresh workers for every iterator; one epoch), then ``fit`` again with loaders
  passed directly (persistent workers), then ``trainer.predict``;
  ``seed_everything(..., workers=True)`` seeds the workers.
- ``ddp``: ``strategy="ddp"`` with 2 CPU processes and ``use_distributed_sampler=True``;
  dpex is imported inside the ``*_dataloader`` hook (after Lightning starts recording).
  Each rank writes ``DIR/rank{R}.pt``. Then, in the same launch (Lightning launches
  its ranks once; a second ``Trainer`` joins the same process group, as in a user's
  script that fits twice), a second fit with ``num_workers=dpex.Autoscale(1, 3)`` and
  ``worker_seeding="per_batch"`` for dpex (torch's loader: 2 workers) writes
  ``DIR/autoscale_rank{R}.pt``: the rebuilt loader must keep the policy, and the
  items (not their worker RNG draws) must match.
- ``ddp_spawn``: ``strategy="ddp_spawn"``: the loaders are pickled into the ranks.
"""

import argparse
import os
import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

N_TRAIN, N_VAL, N_PREDICT = 40, 12, 10


class Noisy(Dataset):
    """Item i: features, a target, one draw from the worker's torch RNG (equal only if the
    worker seeds are equal) and the pid of the raylet that started the process that made
    it (0: not a Ray worker)."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        i += self.offset
        x = torch.tensor([i / 10, (i % 7) / 7, torch.rand(()).item()])
        return x, torch.tensor(float(i % 5)), torch.tensor(int(os.environ.get("RAY_RAYLET_PID", "0")))


def loader_class(kind: str):
    if kind == "torch":
        return DataLoader, {}  # torch's default start method, as the user runs it
    from dpex import DpexDataLoader  # first imported here: inside Lightning's hook, for ddp

    return DpexDataLoader, {"distribute_mode": True}


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.record = {"train": [], "val": [], "loss": [], "pids": set()}

    def _split(self, batch):
        x, y, pid = batch
        self.record["pids"].update(pid.tolist())
        return x, y

    def training_step(self, batch, batch_idx):
        x, y = self._split(batch)
        loss = ((self.layer(x).squeeze(-1) - y) ** 2).mean()
        self.record["train"].append((x.clone(), y.clone()))
        self.record["loss"].append(loss.detach().clone())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = self._split(batch)
        self.record["val"].append((x.clone(), y.clone()))

    def predict_step(self, batch, batch_idx):
        x, _ = self._split(batch)
        return self.layer(x).squeeze(-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Data(pl.LightningDataModule):
    def __init__(self, kind: str, persistent: bool = False, autoscale: bool = False) -> None:
        super().__init__()
        self.kind, self.persistent, self.autoscale = kind, persistent, autoscale

    def _loader(self, dataset, shuffle):
        cls, extra = loader_class(self.kind)
        workers = 2
        if self.autoscale and self.kind == "dpex":
            import dpex

            workers = dpex.Autoscale(1, 3, interval=0.5)
            extra = {**extra, "worker_seeding": "per_batch"}
        return cls(dataset, batch_size=4, shuffle=shuffle, num_workers=workers,
                   persistent_workers=self.persistent, **extra)

    def train_dataloader(self):
        return self._loader(Noisy(N_TRAIN), shuffle=True)

    def val_dataloader(self):
        return self._loader(Noisy(N_VAL, offset=100), shuffle=False)


def trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      deterministic=True, **kwargs)


def describe(loader) -> dict:
    return {"class": type(loader).__name__,
            "distribute_mode": getattr(loader, "distribute_mode", None),
            "sampler": type(loader.sampler).__name__,
            "num_workers": repr(loader.num_workers),
            "batch_sampler": type(loader.batch_sampler).__name__}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--loader", choices=["dpex", "torch"], required=True)
    p.add_argument("--scenario", choices=["single", "ddp", "ddp_spawn"],
                   required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out: dict = {"trainer_pid": os.getpid()}

    if args.scenario == "single":
        pl.seed_everything(3, workers=True)
        model = Model()
        t = trainer(devices=1, max_epochs=1)  # sanity check, train, val: 3 iterators
        t.fit(model, datamodule=Data(args.loader))
        out["fit_datamodule"] = describe(t.train_dataloader)
        # Loaders passed directly, with persistent workers: Lightning keeps these objects.
        data = Data(args.loader, persistent=True)
        train, val = data.train_dataloader(), data.val_dataloader()
        t = trainer(devices=1, max_epochs=2, num_sanity_val_steps=0)
        t.fit(model, train_dataloaders=train, val_dataloaders=val)
        out["fit_direct"] = describe(t.train_dataloader)
        predictions = t.predict(model, dataloaders=data._loader(Noisy(N_PREDICT, 200), False))
        out["predictions"] = [p.clone() for p in predictions]
        out["predict"] = describe(t.predict_dataloaders)
        for loader in (train, val):
            if hasattr(loader, "close"):
                loader.close()
        out.update(model.record)
        torch.save(out, os.path.join(args.out, "rank0.pt"))
        print("rank 0 done", flush=True)
    else:
        pl.seed_everything(5, workers=True)
        # One epoch, no sanity check: every worker start costs seconds on 2 cores.
        def ddp_trainer(prefix: str = "") -> pl.Trainer:
            return trainer(devices=2, strategy=args.scenario, max_epochs=1,
                           num_sanity_val_steps=0, use_distributed_sampler=True,
                           callbacks=[Save(args.out, prefix)])

        if args.scenario == "ddp":
            ddp_trainer().fit(Model(), datamodule=Data(args.loader))
            ddp_trainer("autoscale_").fit(Model(), datamodule=Data(args.loader, autoscale=True))
        else:  # the loaders are pickled into the spawned ranks
            data = Data(args.loader)
            ddp_trainer().fit(Model(), train_dataloaders=data.train_dataloader(),
                              val_dataloaders=data.val_dataloader())


class Save(pl.Callback):
    """Each rank writes what it saw when its fit ends (in the rank's own process)."""

    def __init__(self, out: str, prefix: str = "") -> None:
        self.out, self.prefix = out, prefix

    def on_fit_end(self, trainer, module) -> None:
        record = {"trainer_pid": os.getpid(), "fit": describe(trainer.train_dataloader),
                  **module.record}
        torch.save(record, os.path.join(self.out, f"{self.prefix}rank{trainer.global_rank}.pt"))
        print(f"{self.prefix}rank {trainer.global_rank} done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
