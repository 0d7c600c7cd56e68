"""HF Accelerate resuming mid-epoch with ``save_state`` / ``load_state``, run by
tests/test_resume_frameworks.py.

    python tests/accelerate_resume_app.py --loader dpex|torch --mode full|stop|resume --out DIR

``full`` trains 2 epochs; ``stop`` trains the same and is preempted right after
``accelerator.save_state`` at step ``STOP_AT`` (mid-way through the second epoch);
``resume`` calls ``accelerator.load_state`` and trains to the end. ``--loader torch`` is
the plain script (torch's DataLoader through ``accelerator.prepare``); ``--loader dpex``
uses ``dpex.accelerate.prepare_data_loader``. Each writes ``DIR/{mode}.pt``: the
batches of its steps and its losses.
"""

import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate_app import Noisy  # noqa: E402

EPOCHS, STOP_AT = 2, 8  # 6 batches per epoch: step 8 is batch 2 of epoch 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loader", choices=["dpex", "torch"], required=True)
    parser.add_argument("--mode", choices=["full", "stop", "resume"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    kwargs = dict(batch_size=7, shuffle=True, num_workers=2,
                  generator=torch.Generator().manual_seed(1))
    if args.loader == "torch":
        loader = accelerator.prepare(DataLoader(Noisy(42), **kwargs))
    else:
        from dpex import DpexDataLoader
        from dpex.accelerate import prepare_data_loader

        loader = prepare_data_loader(accelerator, DpexDataLoader(Noisy(42), distribute_mode=True,
                                                                 **kwargs))
    ckpt = os.path.join(args.out, "state")
    step, first_epoch, steps = 0, 0, []
    if args.mode == "resume":
        accelerator.load_state(ckpt)
        with open(os.path.join(ckpt, "progress.json")) as f:
            progress = json.load(f)
        step, first_epoch = progress["step"], progress["epoch"]
    for epoch in range(first_epoch, EPOCHS):
        for batch in loader:
            loss = ((model(batch["x"]).squeeze(-1) - batch["labels"]) ** 2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps.append((epoch, batch["x"].clone(), loss.detach().clone()))
            step += 1
            if args.mode == "stop" and step == STOP_AT:
                accelerator.save_state(ckpt)
                with open(os.path.join(ckpt, "progress.json"), "w") as f:
                    json.dump({"step": step, "epoch": epoch}, f)
                break
        else:
            continue
        break  # preempted
    base = getattr(loader, "base_dataloader", loader)
    if hasattr(base, "close"):
        base.close()
    torch.save({"steps": steps}, os.path.join(args.out, f"{args.mode}.pt"))
    print("done", args.mode, len(steps), flush=True)


if __name__ == "__main__":
    main()
