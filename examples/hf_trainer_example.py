"""transformers.Trainer with dpex: override the two loader hooks, nothing else changes.

    python examples/hf_trainer_example.py

The Trainer builds and prepares its loaders itself; ``prepare_data_loader`` puts a
DpexDataLoader with the same sampler, collator and seeding in place of the plain one.
``dataloader_num_workers`` is the number of dpex workers.
"""

import argparse
import tempfile

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments, set_seed

from dpex.accelerate import prepare_data_loader


class DpexTrainer(Trainer):
    def get_train_dataloader(self):
        return prepare_data_loader(self.accelerator, super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return prepare_data_loader(self.accelerator, super().get_eval_dataloader(eval_dataset))


class Noisy(Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        x = torch.tensor([i / 256, (i % 7) / 7]) + 0.01 * torch.randn(2)
        return {"x": x, "labels": torch.tensor(float(i % 3))}


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def forward(self, x, labels=None):
        out = self.layer(x).squeeze(-1)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    epochs = p.parse_args().epochs
    set_seed(0)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, num_train_epochs=epochs, learning_rate=0.01,
                                 per_device_train_batch_size=32, dataloader_num_workers=2,
                                 report_to=[], save_strategy="no", logging_strategy="epoch",
                                 disable_tqdm=True)
        trainer = DpexTrainer(model=Regressor(), args=args, train_dataset=Noisy(),
                              eval_dataset=Noisy())
        trainer.train()
        loader = trainer.get_train_dataloader()
        print(f"eval loss {trainer.evaluate()['eval_loss']:.4f} "
              f"(batches from a {type(loader.base_dataloader).__name__})")
