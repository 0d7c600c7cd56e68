"""What a worker costs: node memory, trainer memory and first batch, dpex against a fork.

torch's DataLoader (its default start method, fork, as a user gets it) and dpex
(``distribute_mode=True``, Ray already running: the embedded default, started and
timed apart) each load a dataset that holds ``--mib`` MiB in the trainer's memory,
in three kinds: a torch tensor (rows of 64 float32), a NumPy array (the same), and a
Python list of short strings (16-40 characters, as many as make the process's RSS
grow by ``--mib`` when it builds them; each item becomes a 40-byte uint8 tensor);
and a fourth, ``packed``: the same strings as ``dpex.PackedStrings`` (two arrays).
``persistent_workers=True``, ``batch_size=64``, in order, ``--batches`` batches taken.
Every (dataset, workers, loader) runs in a fresh process of its own, so that each
memory figure starts clean; runs alternate torch, dpex, dpex, torch, ...

Measured in each run, with the workers alive (after the first ``--batches``
batches, sampled ``--samples`` times, the largest figure kept):

- **node MiB**: ``MemAvailable`` (``/proc/meminfo``) just before ``iter()`` minus
  ``MemAvailable`` during the iteration: what the whole node gave the loader (Ray's
  object store and the shared-memory rings included, as ``Shmem``);
- **own PSS +MiB**: the PSS of the trainer and all its descendants (its workers;
  dpex: Ray's own processes too, which the embedded default runs as its children)
  during the iteration, above that of the same tree before ``iter()``: the node memory
  the run's own processes added, shared pages counted once, that other processes on
  the node do not move;
- **workers' PSS MiB**: the proportional set size of the worker processes (torch:
  the trainer's child processes; dpex: each worker's actor process, its session's
  process and their children), pages shared with other processes split between them
  (a forked torch worker's share of the trainer's libraries and dataset included);
- **workers' USS MiB**: the same processes' private pages, what their exit would free;
- **trainer RSS +MiB**: the trainer's resident memory during the iteration above its
  level before ``iter()``;
- **Shmem +MiB**: the node's shared memory (``Shmem``) above its level before
  ``iter()``: dpex's shipped dataset in Ray's object store and its rings;
- **first batch s**: ``iter()`` to the first batch of the process's first iterator,
  ``--setup`` seconds (default 5: the trainer's own set-up, a model and an optimizer)
  after the loader was built (dpex starts its worker hosts when the loader is built).
  Memory is read from before the loader is built;
- **no head start s**: the same first batch in another fresh process that builds the
  loader and iterates at once (a notebook cell, Lightning's ``train_dataloader()``,
  README's example), as ``scripts/bench_cold_start.py`` measures it link by link.

Then, per loader and dataset: node memory per added worker, (node MiB at the most
workers - node MiB at the fewest) / (the difference in workers), and the same for
own PSS and the workers' USS.

    python scripts/bench_worker_cost.py                    # 256 MiB, 2 and 6 workers
    python scripts/bench_worker_cost.py --kinds tensor strings --workers 2,4
    python scripts/bench_worker_cost.py --quick            # 16 MiB, 1 and 2 workers

Writes two markdown tables to stdout (progress to stderr), the JSON of the results
to ``--out`` (default docs/bench/worker_cost.json) and a PNG plot beside it
(worker_cost.png; skipped, with a message, without matplotlib). MemAvailable is the
node's: other processes that start or stop during a run move it.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("tensor", "numpy", "strings", "packed")
LOADERS = ("torch", "dpex")
ROW = 64  # float32 per row of the tensor and NumPy datasets (256 bytes)
BATCH = 64
STRING_BYTES = 40  # each string item becomes a uint8 tensor of this length


# -- /proc readings ------------------------------------------------------------------

def meminfo_mib(field: str) -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def status_mib(pid: int | str = "self") -> dict[str, float]:
    """VmRSS and its parts (RssAnon, RssFile, RssShmem) of one process, MiB."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def rss_mib(pid: int | str = "self") -> float:
    return status_mib(pid).get("VmRSS", 0.0)


def smaps_mib(pid: int) -> dict[str, float]:
    """PSS and USS (private pages) of one process; zeros for one that is gone."""
    out = {"pss": 0.0, "uss": 0.0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "Pss":
                    out["pss"] = int(rest.split()[0]) / 1024
                elif key in ("Private_Clean", "Private_Dirty"):
                    out["uss"] += int(rest.split()[0]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def descendants(roots: set[int]) -> set[int]:
    """``roots`` and every live process below them."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found = {p for p in roots if p in parent}
    grew = True
    while grew:
        below = {p for p, pp in parent.items() if pp in found} - found
        found |= below
        grew = bool(below)
    return found


# -- one configuration, in a process of its own --------------------------------------

def build(kind: str, mib: int):
    """The dataset's data and the trainer's RSS growth in building it (MiB)."""
    import numpy as np
    import torch

    before = rss_mib()
    if kind == "tensor":
        data = torch.arange(mib * 1024 * 1024 // 4, dtype=torch.float32).reshape(-1, ROW)
    elif kind == "numpy":
        data = np.arange(mib * 1024 * 1024 // 4, dtype=np.float32).reshape(-1, ROW)
    else:  # strings until the process has grown by ``mib`` (objects, list and allocator)
        data, chunk = [], 1 << 14
        while rss_mib() - before < mib:
            start = len(data)
            data.extend(f"{i:08d}-" + "abcdefghijklmnopqrstuvwxyzABCDEFG"[: 7 + i * 7919 % 25]
                        for i in range(start, start + chunk))
        if kind == "packed":  # the same strings as dpex.PackedStrings (two arrays)
            from dpex import PackedStrings

            data = PackedStrings(data)
            gc.collect()  # the list's memory back to the system before anything is read
            ctypes.CDLL(None).malloc_trim(0)
    return data, rss_mib() - before


def make_dataset(kind: str, data):
    import torch
    from torch.utils.data import Dataset

    class Held(Dataset):
        """Items read from data held in memory: a row (tensor, NumPy) or a string."""

        def __init__(self, kind: str, data) -> None:
            self.kind, self.data = kind, data

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i: int) -> torch.Tensor:
            if self.kind == "tensor":
                return self.data[i].clone()
            if self.kind == "numpy":
                return torch.from_numpy(self.data[i].copy())
            raw = self.data[i].encode().ljust(STRING_BYTES, b"\0")
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    return Held(kind, data)


def settle(limit_s: float) -> None:
    """Wait until MemAvailable holds still (within 8 MiB over 1 s), at most limit_s."""
    deadline, last = time.monotonic() + limit_s, meminfo_mib("MemAvailable")
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = meminfo_mib("MemAvailable")
        if abs(now - last) < 8:
            return
        last = now


def worker_pids(loader_name: str, it) -> set[int]:
    if loader_name == "torch":
        return descendants({os.getpid()}) - {os.getpid()}
    roots = set()
    for w in it.stats()["workers"].values():
        roots.update(p for p in (w.get("pid"), w.get("session_pid")) if isinstance(p, int))
    return descendants(roots)


def run_one(loader_name: str, kind: str, workers: int, mib: int, batches: int,
            samples: int, setup_s: float, settle_s: float = 15.0) -> dict:
    from torch.utils.data import DataLoader

    out: dict = {"loader": loader_name, "kind": kind, "workers": workers}
    if loader_name == "dpex":
        from dpex._ray_connect import connect_ray

        t = time.perf_counter()
        connect_ray("auto")
        out["ray_start_s"] = time.perf_counter() - t
    data, out["dataset_rss_mib"] = build(kind, mib)
    out["items"] = len(data)
    dataset = make_dataset(kind, data)
    del data
    # In order: a shuffle's index list (torch.randperm(n).tolist(), 36 bytes an item)
    # would be the sampler's, in the trainer, the same for both loaders.
    kw = dict(batch_size=BATCH, num_workers=workers, persistent_workers=True)
    gc.collect()
    settle(settle_s)  # (Ray's own processes, started above, finish starting)
    me = os.getpid()
    # Before the loader is built: dpex starts its worker hosts then (Ray running), and
    # what they hold is the loader's.
    avail0, shmem0, trainer0 = meminfo_mib("MemAvailable"), meminfo_mib("Shmem"), status_mib()
    tree0 = descendants({me})  # the trainer and its children (dpex: Ray's own processes)
    out["tree_before"] = {"processes": len(tree0) - 1,
                          "pss_mib": sum(smaps_mib(p)["pss"] for p in tree0)}
    t = time.perf_counter()
    if loader_name == "torch":
        loader = DataLoader(dataset, **kw)
    else:
        from dpex import DpexDataLoader

        loader = DpexDataLoader(dataset, distribute_mode=True, **kw)
    out["build_s"] = time.perf_counter() - t
    # The trainer's own set-up between building its loader and iterating (a model,
    # an optimizer): dpex's hosts start meanwhile.
    time.sleep(setup_s)
    t = time.perf_counter()
    it = iter(loader)
    next(it)
    out["first_batch_s"] = time.perf_counter() - t
    out["load_1min"] = os.getloadavg()[0]  # (a shared machine's other work slows it)
    if samples == 0:  # (the first batch alone: no head start, see spawn)
        if loader_name == "dpex":
            loader.close()
        return out
    for _ in range(batches - 1):
        next(it)
    readings = []
    for _ in range(samples):
        time.sleep(0.5)
        pids = worker_pids(loader_name, it)
        per = [smaps_mib(p) for p in pids]
        parts = [status_mib(p) for p in pids]
        trainer = status_mib()
        tree = descendants({me})
        readings.append({
            "node_mib": avail0 - meminfo_mib("MemAvailable"),
            "shmem_mib": meminfo_mib("Shmem") - shmem0,
            "tree_pss_mib": sum(smaps_mib(p)["pss"] for p in tree) - out["tree_before"]["pss_mib"],
            "tree_processes": len(tree) - 1,
            "trainer_rss_mib": trainer["VmRSS"] - trainer0["VmRSS"],
            "trainer_anon_mib": trainer["RssAnon"] - trainer0["RssAnon"],
            "trainer_shmem_mib": trainer["RssShmem"] - trainer0["RssShmem"],
            "workers_pss_mib": sum(r["pss"] for r in per),
            "workers_uss_mib": sum(r["uss"] for r in per),
            "workers_anon_mib": sum(r.get("RssAnon", 0.0) for r in parts),
            "workers_shmem_mib": sum(r.get("RssShmem", 0.0) for r in parts),
            "worker_processes": len(pids),
        })
        next(it)  # (the workers keep working between readings)
    out["readings"] = readings
    for key in readings[0]:
        out[key] = max(r[key] for r in readings)
    if loader_name == "dpex":
        import ray

        from dpex import release_warm_workers

        loader.close()
        release_warm_workers()
        ray.shutdown()
    else:
        del it, loader  # (persistent workers end with their loader's iterator)
    return out


# -- the parent: runs, tables, plot ---------------------------------------------------

def spawn(loader_name: str, kind: str, workers: int, args: argparse.Namespace,
          at_once: bool = False) -> dict:
    """One configuration in a fresh process (its own session: on a timeout the whole
    group, Ray's processes included, is killed); ``at_once``: only the first batch,
    the loader iterated as soon as it is built."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if args.ray_address:
        env["RAY_ADDRESS"] = args.ray_address
    env.setdefault("PYTHONPATH", ROOT)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", loader_name, kind,
           str(workers), "--mib", str(args.mib), "--batches", str(args.batches),
           "--samples", "0" if at_once else str(args.samples),
           "--setup", "0" if at_once else str(args.setup), "--settle", str(args.settle)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(2.0)
        proc.communicate()
        raise SystemExit(f"{loader_name}, {kind}, {workers} workers: no result after "
                         f"{args.timeout} s") from None
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{loader_name}, {kind}, {workers} workers failed "
                         f"(rc {proc.returncode}):\n{stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def per_added_worker(results: dict, key: str, loader_name: str, kind: str) -> float | None:
    counts = sorted(results[loader_name][kind])
    if len(counts) < 2:
        return None
    lo, hi = counts[0], counts[-1]
    return ((results[loader_name][kind][hi][key] - results[loader_name][kind][lo][key])
            / (hi - lo))


COLUMNS = (("node_mib", "node MiB", "{:.0f}"), ("tree_pss_mib", "own PSS +MiB", "{:.0f}"),
           ("workers_pss_mib", "workers' PSS MiB", "{:.0f}"),
           ("workers_uss_mib", "workers' USS MiB", "{:.0f}"),
           ("trainer_rss_mib", "trainer RSS +MiB", "{:.0f}"),
           ("shmem_mib", "Shmem +MiB", "{:.0f}"), ("first_batch_s", "first batch s", "{:.2f}"),
           ("first_batch_at_once_s", "no head start s", "{:.2f}"))


def tables(results: dict, kinds: list[str], counts: list[int]) -> str:
    """One row per (dataset, workers, loader), dpex's beside torch's (the difference in
    brackets, or the ratio for the first batch); then the cost of an added worker."""
    rows = ["| dataset | workers | loader | " + " | ".join(c[1] for c in COLUMNS) + " |",
            "|---|---:|---|" + "---:|" * len(COLUMNS)]
    for kind in kinds:
        for n in counts:
            t = results["torch"][kind][n]
            for name in LOADERS:
                r, cells = results[name][kind][n], []
                for key, _, fmt in COLUMNS:
                    if key not in r:
                        cells.append("-")
                        continue
                    cell = fmt.format(r[key])
                    if name != "torch" and key.startswith("first_batch"):
                        cell += f" (×{r[key] / max(t[key], 1e-6):.0f})"
                    elif name != "torch" and key != "shmem_mib":
                        cell += f" ({r[key] - t[key]:+.0f})"
                    cells.append(cell)
                rows.append(f"| {kind} | {n} | {name} | " + " | ".join(cells) + " |")
    out = "\n".join(rows)
    if len(counts) > 1:
        lo, hi = counts[0], counts[-1]
        rows = ["| dataset | node MiB: torch | dpex | dpex - torch | own PSS MiB: torch "
                "| dpex | dpex - torch | dpex / torch | workers' USS MiB: torch | dpex |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for kind in kinds:
            cells = []
            for key in ("node_mib", "tree_pss_mib"):
                t = per_added_worker(results, key, "torch", kind)
                d = per_added_worker(results, key, "dpex", kind)
                cells += [f"{t:.0f}", f"{d:.0f}", f"{d - t:+.0f}"]
            cells.append(f"{d / t:.0f}" if t >= 1 else "-")
            cells += [f"{per_added_worker(results, 'workers_uss_mib', name, kind):.0f}"
                      for name in LOADERS]
            rows.append(f"| {kind} | " + " | ".join(cells) + " |")
        out += (f"\n\nPer added worker, ({hi} workers - {lo}) / {hi - lo}:\n\n"
                + "\n".join(rows))
    return out


def plot(results: dict, kinds: list[str], counts: list[int], args: argparse.Namespace,
         path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"(no matplotlib: no plot at {path})", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"torch": "tab:blue", "dpex": "tab:orange"}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    labels = [f"{k}\n{n} w" for k in kinds for n in counts]
    x = range(len(labels))
    panels = (("tree_pss_mib", "own processes' PSS added, MiB", axes[0][0]),
              ("trainer_rss_mib", "trainer RSS growth, MiB", axes[1][0]),
              ("first_batch_s", "first batch, s", axes[1][1]))
    for key, title, ax in panels:
        for j, name in enumerate(LOADERS):
            values = [max(results[name][k][n][key], 0.01) for k in kinds for n in counts]
            bars = ax.bar([i + (j - 0.5) * 0.4 for i in x], values, 0.4, label=name,
                          color=colors[name])
            ax.bar_label(bars, fmt="%.2f" if key == "first_batch_s" else "%.0f",
                         fontsize=7)
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title + " (log)")
        ax.legend(fontsize=8)
    ax = axes[0][1]
    if len(counts) > 1:  # own PSS (solid) and MemAvailable (hatched), per loader
        bars_of = [(name, key) for key in ("tree_pss_mib", "node_mib") for name in LOADERS]
        for j, (name, key) in enumerate(bars_of):
            real = [per_added_worker(results, key, name, k) for k in kinds]
            values = [max(v, 0.5) for v in real]
            bars = ax.bar([i + (j - 1.5) * 0.2 for i in range(len(kinds))], values, 0.2,
                          color=colors[name], hatch="//" if key == "node_mib" else None,
                          alpha=0.6 if key == "node_mib" else 1.0,
                          label=f"{name}, {'MemAvailable' if key == 'node_mib' else 'own PSS'}")
            ax.bar_label(bars, labels=[f"{v:.0f}" for v in real], fontsize=7)
        ax.set_xticks(range(len(kinds)), kinds)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    ax.set_title("per added worker, MiB (log; below 1 drawn at 0.5)")
    fig.suptitle(f"What a worker costs: {args.mib} MiB dataset, batch {BATCH}, "
                 f"persistent workers, {os.cpu_count()} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="dataset size in the trainer")
    p.add_argument("--workers", default="2,6", help="worker counts, comma-separated")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--batches", type=int, default=40, help="batches before the readings")
    p.add_argument("--samples", type=int, default=5, help="readings, 0.5 s apart")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    p.add_argument("--setup", type=float, default=5.0,
                   help="seconds between building the loader and iter() (the trainer's "
                        "own set-up: a model, an optimizer; 0: iterate at once)")
    p.add_argument("--settle", type=float, default=15.0,
                   help="at most this many seconds for the node's memory to hold still "
                        "before the readings start (a smoke run: 1)")
    p.add_argument("--ray-address", default="",
                   help="every configuration joins this running Ray (default: each starts "
                        "the embedded default of its own, as a fresh script does)")
    p.add_argument("--quick", action="store_true",
                   help="16 MiB, 1 and 2 workers, 8 batches, 3 readings (a smoke run)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "bench", "worker_cost.json"),
                   help="JSON of the results; the plot goes beside it")
    p.add_argument("--child", nargs=3, metavar=("LOADER", "KIND", "WORKERS"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        name, kind, n = args.child
        result = run_one(name, kind, int(n), args.mib, args.batches, args.samples,
                         args.setup, args.settle)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.quick:
        args.mib, args.workers, args.batches, args.samples = 16, "1,2", 8, 3
    counts = sorted({int(n) for n in args.workers.split(",")})
    configs = [(kind, n) for kind in args.kinds for n in counts]
    results: dict = {name: {kind: {} for kind in args.kinds} for name in LOADERS}
    started, step, total = time.perf_counter(), 0, len(configs) * len(LOADERS)
    for c, (kind, n) in enumerate(configs):
        for name in (LOADERS if c % 2 == 0 else LOADERS[::-1]):
            step += 1
            t = time.perf_counter()
            r = results[name][kind][n] = spawn(name, kind, n, args)
            if args.setup > 0:  # beside it: no head start, in a fresh process of its own
                r["first_batch_at_once_s"] = spawn(name, kind, n, args, True)["first_batch_s"]
            ray = f", Ray start {r['ray_start_s']:.1f} s" if "ray_start_s" in r else ""
            print(f"[{step}/{total}] {name}, {kind} ({r['items']:,} items, "
                  f"{r['dataset_rss_mib']:.0f} MiB), {n} workers: node +{r['node_mib']:.0f} "
                  f"MiB, own PSS +{r['tree_pss_mib']:.0f} MiB, workers' PSS "
                  f"{r['workers_pss_mib']:.0f} MiB ({r['worker_processes']} processes), "
                  f"trainer +{r['trainer_rss_mib']:.0f} MiB, first batch "
                  f"{r['first_batch_s']:.2f} s ({r.get('first_batch_at_once_s', 0):.2f} s "
                  f"with no head start; load {r['load_1min']:.1f}){ray} "
                  f"({time.perf_counter() - t:.0f} s, {time.perf_counter() - started:.0f} s "
                  "in all)", file=sys.stderr, flush=True)
    loads = [r["load_1min"] for name in LOADERS for kind in args.kinds
             for r in results[name][kind].values()]
    print(f"{args.mib} MiB dataset, batch {BATCH}, persistent workers, {args.batches} "
          f"batches, {args.setup:g} s between building the loader and iter(); "
          f"{platform.node() or 'this host'}, {os.cpu_count()} cores, load average "
          f"(1 min) at the first batches {min(loads):.1f}-{max(loads):.1f}\n")
    print(tables(results, args.kinds, counts))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "cores": os.cpu_count(),
                   "args": vars(args), "results": results}, f, indent=1)
    plot(results, args.kinds, counts, args,
         os.path.splitext(os.path.abspath(args.out))[0] + ".png")


if __name__ == "__main__":
    main()
