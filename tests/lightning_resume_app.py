"""Lightning resuming mid-epoch from a checkpoint, run by tests/test_resume_frameworks.py.

    python tests/lightning_resume_app.py --loader dpex|torch --mode full|stop|resume --out DIR

``full`` fits 2 epochs; ``stop`` fits the same and is preempted (an exception) right
after saving a checkpoint at global step ``STOP_AT`` (mid-way through the second
epoch); ``resume`` fits from that checkpoint (``Trainer.fit(ckpt_path=...)``). Each
writes the batches of its training steps and its losses to ``DIR/{mode}.pt``.
"""

import argparse
import os
import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning_app import Noisy  # noqa: E402

EPOCHS, STOP_AT = 2, 7  # 5 batches per epoch: step 7 is batch 2 of epoch 2


class Preempted(Exception):
    pass


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.steps = []

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = ((self.layer(x).squeeze(-1) - y) ** 2).mean()
        self.steps.append((self.current_epoch, batch_idx, x.clone(), loss.detach().clone()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class StopAfterCheckpoint(pl.Callback):
    """Save a checkpoint at global step STOP_AT, then end the job there: by raising
    ``Preempted`` (one process), or with ``raise_=False`` by asking the trainer to stop
    (DDP: every rank must stop at the same step, or the others would wait for it)."""

    def __init__(self, path: str, raise_: bool = True) -> None:
        self.path, self.raise_ = path, raise_

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == STOP_AT:
            trainer.save_checkpoint(self.path)
            if self.raise_:
                raise Preempted
            trainer.should_stop = True  # the job is preempted here


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loader", choices=["dpex", "torch"], required=True)
    parser.add_argument("--mode", choices=["full", "stop", "resume"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pl.seed_everything(0, workers=True)
    if args.loader == "torch":
        cls, extra = DataLoader, {}
    else:
        from dpex import DpexDataLoader

        cls, extra = DpexDataLoader, {"distribute_mode": True}
    loader = cls(Noisy(40), batch_size=8, shuffle=True, num_workers=2,
                 generator=torch.Generator().manual_seed(1), **extra)
    model = Model()
    ckpt = os.path.join(args.out, "mid_epoch.ckpt")
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[StopAfterCheckpoint(ckpt)] if args.mode == "stop" else [])
    try:
        trainer.fit(model, loader, ckpt_path=ckpt if args.mode == "resume" else None)
    except Preempted:
        pass
    if hasattr(loader, "close"):
        loader.close()
    torch.save({"steps": model.steps}, os.path.join(args.out, f"{args.mode}.pt"))
    print("done", args.mode, len(model.steps), flush=True)


if __name__ == "__main__":
    main()
