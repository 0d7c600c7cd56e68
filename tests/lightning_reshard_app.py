"""Lightning under DDP, checkpointed mid-epoch on 2 devices and resumed on 1, run by
tests/test_resume_frameworks.py as a user runs it.

    python tests/lightning_reshard_app.py --mode stop|resume --out DIR

``stop``: ``strategy="ddp"`` on 2 CPU devices; at global step STOP_AT (batch 2 of the
second epoch) the callback saves a checkpoint (Lightning keeps rank 0's loader state)
and stops the fit. ``resume``: the same script on 1 device (``strategy="ddp"``, one
rank) fits from that checkpoint (``ckpt_path=``). The loader is unmodified: Lightning
rebuilds it with its own DistributedSampler for each device count. Every rank writes
``DIR/{mode}_rank{r}.pt``: its steps' (epoch, batch index, sample indices,
augmentations) and its sampler's seed.
"""

import argparse
import os
import sys

import pytorch_lightning as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning_app import Noisy  # noqa: E402
from lightning_resume_app import Model as ResumeModel  # noqa: E402
from lightning_resume_app import StopAfterCheckpoint  # noqa: E402

EPOCHS, BATCH = 2, 4  # 40 samples, 2 devices: 5 steps an epoch


class Model(ResumeModel):
    """lightning_resume_app's model, recording each step's sample indices and
    augmentations (the third feature: a draw from the worker's torch RNG)."""

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        self.steps.append((self.current_epoch, batch_idx, torch.round(x[:, 0] * 10).long(),
                           x[:, 2].clone()))
        return ((self.layer(x).squeeze(-1) - y) ** 2).mean()


class Save(pl.Callback):
    def __init__(self, out: str, mode: str) -> None:
        self.out, self.mode = out, mode

    def on_fit_end(self, trainer, module) -> None:
        record = {"steps": module.steps, "seed": trainer.train_dataloader.sampler.seed,
                  "world_size": trainer.world_size}
        torch.save(record, os.path.join(self.out, f"{self.mode}_rank{trainer.global_rank}.pt"))
        print(f"{self.mode} rank {trainer.global_rank} done", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["stop", "resume"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pl.seed_everything(0, workers=True)
    from dpex import DpexDataLoader

    loader = DpexDataLoader(Noisy(40), batch_size=BATCH, shuffle=True, num_workers=1,
                            distribute_mode=True, worker_seeding="per_sample")
    ckpt = os.path.join(args.out, "mid_epoch.ckpt")
    callbacks = [Save(args.out, args.mode)]
    if args.mode == "stop":
        callbacks.append(StopAfterCheckpoint(ckpt, raise_=False))
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", strategy="ddp",
                         devices=2 if args.mode == "stop" else 1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=callbacks)
    trainer.fit(Model(), loader, ckpt_path=ckpt if args.mode == "resume" else None)
    loader.close()


if __name__ == "__main__":
    main()
