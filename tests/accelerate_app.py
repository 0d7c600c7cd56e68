"""An HF Accelerate (and transformers.Trainer) training script, run by
tests/test_accelerate.py as a user runs it, alone or under torchrun.

    python tests/accelerate_app.py --loader dpex|torch --app accelerate|trainer --out DIR

``--loader torch`` is the plain script: torch's DataLoader through
``accelerator.prepare`` (or the stock ``Trainer``). ``--loader dpex`` is the same
script with the supported dpex change: ``dpex.accelerate.prepare_data_loader`` (or a
Trainer whose ``get_train_dataloader`` / ``get_eval_dataloader`` use it). Each
process writes ``DIR/rank{R}.pt`` with its batches, losses, gathered evaluation
outputs, final weights and the ids of the processes that made the items.
"""

import argparse
import os
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

N_TRAIN, N_EVAL = 42, 13  # neither divides by batch 4 × 2 ranks: remainders to handle


class Noisy(Dataset):
    """Features, a target, one draw from the worker's RNG, and the pid of the raylet that
    started the process that made the item (0: not a Ray worker)."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        i += self.offset
        return {"x": torch.tensor([i / 10, (i % 7) / 7, torch.rand(()).item()]),
                "labels": torch.tensor(float(i % 5)), "pid": torch.tensor(int(os.environ.get("RAY_RAYLET_PID", "0")))}


class Regressor(nn.Module):
    """A model as transformers.Trainer expects one: keyword inputs, a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.seen: list[torch.Tensor] = []
        self.pids: set[int] = set()

    def forward(self, x, labels=None, pid=None):
        if self.training:
            self.seen.append(x.detach().clone())
        if pid is not None:
            self.pids.update(pid.tolist())
        out = self.layer(x).squeeze(-1)
        loss = ((out - labels) ** 2).mean() if labels is not None else None
        return {"loss": loss, "logits": out}


def run_accelerate(args) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    set_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    kw = {"batch_size": 4, "num_workers": 2}
    train_set, eval_set = Noisy(N_TRAIN), Noisy(N_EVAL, offset=100)
    record: dict = {"loss": [], "batches": [], "gathered": [], "dropped_warning": False}
    if args.loader == "torch":
        train = DataLoader(train_set, shuffle=True, **kw)
        evals = DataLoader(eval_set, **kw)
        model, optimizer, train, evals = accelerator.prepare(model, optimizer, train, evals)
    else:
        from dpex import DpexDataLoader, DpexDroppedWarning
        from dpex.accelerate import prepare_data_loader

        model, optimizer = accelerator.prepare(model, optimizer)
        train = prepare_data_loader(accelerator, DpexDataLoader(
            train_set, shuffle=True, distribute_mode=True, **kw))
        evals = prepare_data_loader(accelerator, DpexDataLoader(
            eval_set, distribute_mode=True, **kw))
        # Passing the prepared loaders through prepare() again leaves them as they are ...
        assert accelerator.prepare(train) is train
        record["classes"] = [type(train.base_dataloader).__name__,
                             type(evals.base_dataloader).__name__]
        # ... and a DpexDataLoader given to prepare() itself is rebuilt by Accelerate as a
        # plain DataLoader: dpex warns (never silently dropped).
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plain = accelerator.prepare(DpexDataLoader(eval_set, distribute_mode=True, **kw))
        record["dropped_warning"] = any(issubclass(w.category, DpexDroppedWarning)
                                        for w in caught)
        record["dropped_class"] = type(plain.base_dataloader).__name__
    for _epoch in range(2):
        model.train()
        for batch in train:
            with accelerator.accumulate(model):
                loss = model(**batch)["loss"]
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            record["loss"].append(loss.detach().clone())
            record["batches"].append(batch["x"].clone())
            record.setdefault("sync", []).append(accelerator.sync_gradients)
        model.eval()
        with torch.no_grad():
            for batch in evals:
                out = model(**batch)["logits"]
                record["gathered"].append(accelerator.gather_for_metrics(out).clone())
    record["weights"] = {k: v.clone() for k, v in accelerator.unwrap_model(model)
                         .state_dict().items()}
    record["pids"] = sorted(accelerator.unwrap_model(model).pids)
    record["rank"] = accelerator.process_index
    return record


def run_trainer(args) -> dict:
    from transformers import Trainer, TrainingArguments, set_seed

    set_seed(0)  # the model's initial weights
    model = Regressor()
    targs = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        num_train_epochs=2, learning_rate=0.05, dataloader_num_workers=2, seed=0,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
        remove_unused_columns=False, optim="sgd", lr_scheduler_type="constant",
        disable_tqdm=True)
    if args.loader == "torch":
        cls = Trainer
    else:
        from dpex.accelerate import prepare_data_loader

        class DpexTrainer(Trainer):
            def get_train_dataloader(self):
                return prepare_data_loader(self.accelerator, super().get_train_dataloader())

            def get_eval_dataloader(self, eval_dataset=None):
                return prepare_data_loader(self.accelerator,
                                           super().get_eval_dataloader(eval_dataset))

        cls = DpexTrainer
    trainer = cls(model=model, args=targs, train_dataset=Noisy(N_TRAIN),
                  eval_dataset=Noisy(N_EVAL, offset=100))
    trainer.train()
    metrics = trainer.evaluate()
    return {"batches": model.seen, "eval_loss": metrics["eval_loss"],
            "weights": {k: v.clone() for k, v in model.state_dict().items()},
            "pids": sorted(model.pids), "rank": trainer.args.process_index,
            "classes": [type(trainer.get_train_dataloader().base_dataloader).__name__]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--loader", choices=["dpex", "torch"], required=True)
    p.add_argument("--app", choices=["accelerate", "trainer"], required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    record = run_accelerate(args) if args.app == "accelerate" else run_trainer(args)
    record["trainer_pid"] = os.getpid()
    torch.save(record, os.path.join(args.out, f"rank{record['rank']}.pt"))
    print(f"rank {record['rank']} done", flush=True)


if __name__ == "__main__":
    main()
