"""Autoscaling benchmark: does ``num_workers=dpex.Autoscale(...)`` find the worker count a
sweep of fixed counts finds best, how fast, and what does the stall share do?

Loops over the same kind of dataset (each batch takes a worker ``--batch-ms``, or its own):

- ``fast``: the loop's step takes 5 ms: it needs about batch/step workers;
- ``slow``: the step takes 60 ms: one worker keeps up;
- ``cpu``: the batch burns CPU instead of waiting (decoding on this machine's cores):
  more workers than cores do not help, whatever the stall;
- ``slow-batch`` and ``slower-batch``: 0.25 s and 1 s batches, a 25 ms step: 10 and 40
  workers keep up (16 at most here);
- ``slow-start``: 50 ms batches, each session loads its dataset for 3 s after its
  HELLO (the added workers' first results come late).

The ``fast`` and ``slow`` batches *wait* (``time.sleep``), as a fetch from remote
storage does, so that one 2-core machine can show what a cluster with enough CPUs
would. For each loop: a sweep of fixed ``num_workers`` (steady-state batches/s, an
epoch after a warm-up one), then ``Autoscale(min=1, max=16)`` from a cold start. Best
fixed count: the fewest workers within 5 % of the sweep's highest rate. Chosen: the
count the autoscaler held most of the run after its first decision. Predicted:
``scale_model.workers_needed`` from the loop's step and the workers' batch time
(``stats()["worker_batch_s"]``) measured with one worker. Settled: the decision that
first reached the chosen count, counted from the autoscaler's first measurement (the
workers' start comes before).

    python scripts/bench_autoscale.py            # ~10 min; writes docs/bench/autoscale.*
    python scripts/bench_autoscale.py --loops slow-batch,slow-start   # (others kept)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cloudpickle  # noqa: E402
import torch  # noqa: E402
from scale_model import workers_needed  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from dpex import Autoscale, DpexDataLoader  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "bench")


class Batches(Dataset):
    """Item i costs ``cost_s``: waited (``burn=False``) or burnt on a CPU. A worker
    takes ``load_s`` to load it (unpickling: its session says HELLO before)."""

    def __init__(self, n: int, cost_s: float, burn: bool, load_s: float = 0.0) -> None:
        self.n, self.cost_s, self.burn, self.load_s = n, cost_s, burn, load_s

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        time.sleep(self.load_s)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.burn:
            end = time.thread_time() + self.cost_s
            while time.thread_time() < end:
                pass
        else:
            time.sleep(self.cost_s)
        return torch.full((256,), float(i))


cloudpickle.register_pickle_by_value(sys.modules[__name__])

LOOPS = {  # name: (step of the training loop s, batch burns CPU, batch s or None for
    # --batch-ms, a worker's time to load the dataset s, autoscaled run s or None)
    "fast": (0.005, False, None, 0.0, None),
    "slow": (0.060, False, None, 0.0, None),
    "cpu": (0.005, True, None, 0.0, None),
    "slow-batch": (0.025, False, 0.25, 0.0, 30.0),  # ~10 workers keep up
    "slower-batch": (0.025, False, 1.0, 0.0, 40.0),  # more than 16 would
    "slow-start": (0.005, False, 0.05, 3.0, 30.0),  # each session loads for 3 s
}
SWEEPS = {"fast": [1, 2, 4, 6, 8, 10, 12], "slow": [1, 2, 3, 4], "cpu": [1, 2, 3, 4],
          "slow-batch": [4, 8, 12, 16], "slower-batch": [4, 8, 16],
          "slow-start": [4, 8, 12, 16]}


def loader(n: int, cost_s: float, burn: bool, workers: int, load_s: float = 0.0
           ) -> DpexDataLoader:
    return DpexDataLoader(Batches(n, cost_s, burn, load_s), batch_size=None,
                          num_workers=workers, persistent_workers=True, distribute_mode=True)


def steady_rate(step_s: float, cost_s: float, burn: bool, workers: int, batches: int,
                load_s: float = 0.0) -> dict:
    """batches/s of the loop in its second epoch (the first starts the workers)."""
    with loader(batches, cost_s, burn, workers, load_s) as ld:
        for _ in ld:
            time.sleep(step_s)
        t0 = time.monotonic()
        for _ in ld:
            time.sleep(step_s)
        wall = time.monotonic() - t0
        stats = ld.stats()
    return {"workers": workers, "rate": batches / wall, "stall_share": stats["data_wait_share"],
            "worker_batch_s": stats["worker_batch_s"]}


def autoscaled(step_s: float, cost_s: float, burn: bool, seconds: float,
               load_s: float = 0.0) -> dict:
    """Autoscale(min=1, max=16) from a cold start, for about ``seconds``."""
    policy = Autoscale(1, 16, interval=0.5)
    n = int(seconds / step_s)
    with DpexDataLoader(Batches(n, cost_s, burn, load_s), batch_size=None,
                        num_workers=policy, distribute_mode=True) as ld:
        t0 = time.monotonic()
        first = None
        for _ in ld:
            if first is None:
                first = time.monotonic() - t0
            time.sleep(step_s)
        report = ld.stats()["autoscale"]
    return {"first_batch_s": first, **report}


def summarize(name: str, sweep: list[dict], auto: dict, predicted: int) -> dict:
    top = max(r["rate"] for r in sweep)
    best = min(r["workers"] for r in sweep if r["rate"] >= 0.95 * top)
    history, decisions = auto["history"], auto["decisions"]
    start = history[0]["t"] if history else 0.0
    first = decisions[0]["t"] if decisions else start
    # what it held most of the time once it had decided (a later retry of a ceiling,
    # a few windows long, is not its choice)
    held = collections.Counter(h["workers"] for h in history if h["t"] > first)
    chosen = held.most_common(1)[0][0] if held else auto["workers"]
    settle = min((d["t"] for d in decisions if d["to"] == chosen), default=start) - start
    tail = history[-5:]
    return {"loop": name, "best_fixed": best, "best_rate": top, "predicted": predicted,
            "chosen": chosen, "decisions": len(decisions),
            "settle_s": settle,
            "stall_before": history[0]["stall_share"] if history else None,
            "stall_after": sum(h["stall_share"] for h in tail) / len(tail) if tail else None}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(results))
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(results):]:
        ax.set_visible(False)
    for ax, (name, res) in zip(axes.flat, results.items(), strict=False):
        hist = res["auto"]["history"]
        t = [h["t"] for h in hist]
        ax.step(t, [h["workers"] for h in hist], where="post", color="tab:blue",
                label="workers")
        ax.axhline(res["summary"]["best_fixed"], color="tab:blue", ls=":",
                   label="best fixed count")
        ax.set_xlabel("seconds since the autoscaler started")
        ax.set_ylabel("workers", color="tab:blue")
        ax.set_ylim(0, max([h["workers"] for h in hist] + [res["summary"]["best_fixed"]]) + 1)
        ax.set_title(f"{name} loop")
        share = ax.twinx()
        share.plot(t, [100 * h["stall_share"] for h in hist], color="tab:red",
                   label="data stall %")
        share.axhline(5, color="tab:red", ls=":", label="target 5 %")
        share.set_ylabel("data stall %", color="tab:red")
        share.set_ylim(0, 100)
        ax.legend(loc="center right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(rows: list[dict]) -> str:
    lines = ["| loop | best fixed count (sweep) | predicted (scale_model) | autoscaler chose "
             "| settled after | stall share: first window → last 5 |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['loop']} | {r['best_fixed']} ({r['best_rate']:.0f} batches/s) | "
                     f"{r['predicted']} | {r['chosen']} | {r['settle_s']:.1f} s | "
                     f"{r['stall_before']:.0%} → {r['stall_after']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-ms", type=float, default=40.0, help="a worker's time per batch")
    p.add_argument("--seconds", type=float, default=15.0, help="length of an autoscaled run")
    p.add_argument("--loops", default=",".join(LOOPS))
    p.add_argument("--out", default=OUT)
    p.add_argument("--replot", action="store_true",
                   help="only redo the table and plot from the JSON of the last run")
    args = p.parse_args()
    cost = args.batch_ms / 1000
    results, rows = {}, []
    if args.replot:
        with open(os.path.join(args.out, "autoscale.json")) as f:
            saved = json.load(f)
        for name, res in saved["results"].items():
            res["summary"] = summarize(name, res["sweep"], res["auto"],
                                       res["summary"]["predicted"])
            results[name] = res
            rows.append(res["summary"])
        write(args.out, saved["batch_ms"], results, rows)
        return
    for name in args.loops.split(","):
        step, burn, own_cost, load_s, seconds = LOOPS[name]
        cost_s = own_cost or (cost / 2 if burn else cost)  # (burnt: half, cores are shared)
        batches = max(60, int(4.0 / max(step, cost_s / max(SWEEPS[name]))))
        sweep = []
        for w in SWEEPS[name]:
            print(f"[{name}] fixed num_workers={w} ...", flush=True)
            sweep.append(steady_rate(step, cost_s, burn, w, batches, load_s))
            print(f"[{name}]   {sweep[-1]['rate']:.1f} batches/s", flush=True)
        # the workers' batch time measured with one worker, and the loop's own step; a
        # batch that burns CPU: no more workers than cores help (scale_model's
        # --shared-cores model)
        predicted = workers_needed(sweep[0]["worker_batch_s"], step)
        if burn:
            predicted = min(predicted, os.cpu_count() or 1)
        seconds = seconds or args.seconds
        print(f"[{name}] Autoscale(min=1, max=16), {seconds:g} s ...", flush=True)
        auto = autoscaled(step, cost_s, burn, seconds, load_s)
        summary = summarize(name, sweep, auto, predicted)
        print(f"[{name}] {summary}", flush=True)
        results[name] = {"sweep": sweep, "auto": auto, "summary": summary}
        rows.append(summary)
    write(args.out, args.batch_ms, results, rows)


def write(out: str, batch_ms: float, results: dict, rows: list[dict]) -> None:
    """The JSON, table and plot; loops not run this time keep their last results."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "autoscale.json")
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved.get("batch_ms") == batch_ms:
            results = {**{k: v for k, v in saved["results"].items() if k not in results},
                       **results}
            rows = [results[k]["summary"] for k in LOOPS if k in results]
    with open(os.path.join(out, "autoscale.json"), "w") as f:
        json.dump({"batch_ms": batch_ms, "cpus": os.cpu_count(), "results": results},
                  f, indent=1, default=float)
    md = table(rows)
    with open(os.path.join(out, "autoscale.md"), "w") as f:
        f.write(md + "\n")
    plot(results, os.path.join(out, "autoscale.png"))
    print(md)


if __name__ == "__main__":
    main()
