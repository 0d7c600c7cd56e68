"""Cold start: a process's first batch, dpex beside torch, and where dpex's time goes.

Every configuration runs in a fresh process of its own, with nothing started before
it (no head start: the loader is built and iterated at once, as in a notebook, a
Lightning ``train_dataloader()`` or README's example):

- **first batch, Ray running**: the process starts Ray first (timed apart), builds a
  dataset holding ``--mib`` MiB (a tensor, a NumPy array, a list of strings; the
  datasets of ``scripts/bench_worker_cost.py``), then the loader (2 persistent
  workers, batch 64), and times ``iter()`` to the first batch;
- **first batch, no Ray**: the same, dpex starting its embedded Ray itself;
- **README's example** as a script (``python example.py``): the whole process's wall
  time and the machine's busy CPU-seconds (every process, Ray's included), and torch's
  with ``DataLoader`` in its place;
- **a short Lightning fit**: ``tests/lightning_app.py --scenario single`` (fit with
  validation, fit again with persistent loaders, predict; 2 workers), the same figures
  (``scripts/bench_lightning_cpu.py``'s measure).

The dpex runs of the first two kinds are traced (``DPEX_START_TRACE``, see
``dpex/_start_trace.py``): each process of the start chain marks the links it passes,
and the chain is drawn as a timeline, one row per process (the trainer, the host
actor, its forkserver, the fork base, the sessions). ``--before FILE`` draws an
earlier run's chains above this run's.

    python scripts/bench_cold_start.py                       # everything, 256 MiB
    python scripts/bench_cold_start.py --only ray --kinds tensor --mib 16
    python scripts/bench_cold_start.py --before docs/bench/cold_start_before.json

Writes markdown tables to stdout (progress to stderr), the JSON to ``--out`` (default
docs/bench/cold_start.json) and the plot beside it (cold_start.png).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
TRACE_ENV = "DPEX_START_TRACE"
KINDS = ("tensor", "numpy", "strings")
ONLY = ("ray", "noray", "readme", "lightning")
BATCH, WORKERS = 64, 2
# The chain's rows: a process and the marks that bound its bar (dpex/_start_trace.py).
LINKS = (  # (row, label, from mark, to mark; "a|b": a, else b)
    # Ray's start, on the start thread since the loader was built (issue 50), in iter()
    # before; with Ray running, iter()'s wait for that thread's host start.
    ("trainer", "connect", "ray start|ray connect", "ray up|ray connected"),
    ("trainer", "pickle", "ship", "shipped"),
    ("trainer", "wait", "workers asked", "first batch"),
    ("host", "host actor", "@host", "host init"),  # (from when it was asked for)
    ("forkserver", "forkserver (imports)", "@forkserver", "base forked"),
    ("fork base", "unpickle", "base forked", "base loaded"),
    ("session", "first batch", "session forked", "batch 0 sent"),
)


# -- children ------------------------------------------------------------------------

def child_first_batch(loader_name: str, kind: str, ray_running: bool, mib: int) -> dict:
    import bench_worker_cost as cost
    from torch.utils.data import DataLoader

    from dpex._start_trace import mark

    out: dict = {}
    if ray_running and loader_name == "dpex":
        from dpex._ray_connect import connect_ray

        t = time.perf_counter()
        connect_ray("auto")
        out["ray_start_s"] = time.perf_counter() - t
        quiet(15.0)  # (Ray's own processes finish starting: "Ray running")
    data, _ = cost.build(kind, mib)
    dataset = cost.make_dataset(kind, data)
    del data
    kw = dict(batch_size=BATCH, num_workers=WORKERS, persistent_workers=True)
    from dpex import DpexDataLoader  # (imported before, as a script does at its top)

    mark("build")
    t = time.perf_counter()
    if loader_name == "torch":
        loader = DataLoader(dataset, **kw)
    else:
        loader = DpexDataLoader(dataset, distribute_mode=True, **kw)
    it = iter(loader)
    next(it)
    out["first_batch_s"] = time.perf_counter() - t
    out["load_1min"] = os.getloadavg()[0]
    if loader_name == "dpex":
        loader.close()
    return out


def quiet(limit_s: float) -> None:
    """Until the machine is nearly idle (under a fifth of a core busy over 0.5 s), at
    most ``limit_s``."""
    from bench_lightning_cpu import busy_s

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        c0 = busy_s()
        time.sleep(0.5)
        if busy_s() - c0 < 0.1:
            return


def spawn(args: list[str], env: dict, timeout: float) -> dict:
    """One child in a session of its own (on a timeout its whole group is killed)."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise SystemExit(f"{args}: no result after {timeout} s") from None
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{args} failed (rc {proc.returncode}):\n{stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", TRACE_ENV)}
    env.setdefault("PYTHONPATH", ROOT)
    return env


def traced(args: list[str], timeout: float) -> dict:
    """A dpex child with the start trace on: its result and its chain."""
    with tempfile.TemporaryDirectory() as tmp:
        env = clean_env()
        env[TRACE_ENV] = os.path.join(tmp, "trace.jsonl")
        result = spawn(args, env, timeout)
        time.sleep(1.0)  # (the last marks of processes that end after the trainer)
        with open(env[TRACE_ENV]) as f:
            result["trace"] = [json.loads(line) for line in f if line.strip()]
    return result


def chain(trace: list[dict]) -> list[dict]:
    """The links as bars: row, label, start and end (s after the loader was built)."""
    t0 = min(r["t"] for r in trace if r["link"] == "build")
    by_link: dict[str, list[dict]] = {}
    for r in sorted(trace, key=lambda r: r["t"]):
        by_link.setdefault(r["link"], []).append(r)
    first = {link: rs[0] for link, rs in by_link.items()}
    host_started = first.get("host init", {}).get("started")
    if host_started is not None and "host asked" in first:  # (Ray's idle worker: earlier)
        host_started = max(host_started, first["host asked"]["t"])
    starts = {"@host": host_started,
              "@forkserver": first.get("forkserver ready", {}).get("started")}
    bars = []
    for row, label, a_or, b_or in LINKS:
        a = next((m for m in a_or.split("|") if m in first or m in starts), a_or)
        b = next((m for m in b_or.split("|") if m in first), b_or)
        start = starts.get(a) if a.startswith("@") else first.get(a, {}).get("t")
        end = first.get(b, {}).get("t")
        if start is not None and end is not None:
            cpu = None if a == "@forkserver" else cpu_of(by_link, a, b)  # (not its own)
            bars.append({"row": row, "label": label, "start": max(start - t0, -1.0),
                         "end": end - t0, "cpu": cpu})
    return bars


def cpu_of(by_link: dict, a: str, b: str) -> float | None:
    """CPU-seconds the process that marked ``b`` spent from ``a`` to ``b`` (from its
    start for the host's and the forkserver's own bars)."""
    end = by_link.get(b, [None])[0]
    if end is None:
        return None
    start = next((r for r in by_link.get(a, []) if r["pid"] == end["pid"]), None)
    return end["cpu"] - (start["cpu"] if start else 0.0)


def readme_code(loader_name: str) -> str:
    """README's example as a script; torch's: ``DataLoader`` in its place."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    code = re.search(r"## Example\n\n```python\n(.*?)```", readme, re.S).group(1)
    if loader_name == "torch":
        code = code.replace("from dpex import DpexDataLoader",
                            "from torch.utils.data import DataLoader as DpexDataLoader")
        code = code.replace("distribute_mode=True, ", "")
        code = code.replace("with loader:", "if True:")  # (torch's has no context)
    return code


def timed_script(code: str, timeout: float) -> dict:
    from bench_lightning_cpu import busy_s

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "example.py")
        with open(path, "w") as f:
            f.write(code)
        c0, t0 = busy_s(), time.perf_counter()
        subprocess.run([sys.executable, path], check=True, timeout=timeout, env=clean_env(),
                       cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        time.sleep(2.0)  # (what it left to end: Ray's processes after its exit)
        return {"wall_s": wall, "cpu_s": busy_s() - c0 - 2.0 * idle_rate()}


_IDLE: list[float] = []


def idle_rate() -> float:
    """Busy CPU-seconds per second of this machine at rest (measured once)."""
    if not _IDLE:
        from bench_lightning_cpu import busy_s

        c0 = busy_s()
        time.sleep(3.0)
        _IDLE.append((busy_s() - c0) / 3.0)
    return _IDLE[0]


def lightning(loader_name: str, timeout: float) -> dict:
    import bench_lightning_cpu

    bench_lightning_cpu._idle_rate = idle_rate()
    cpu, wall = bench_lightning_cpu.run(loader_name, timeout)
    return {"wall_s": wall, "cpu_s": cpu}


# -- the parent: runs, tables, plot ---------------------------------------------------

def run_all(args: argparse.Namespace) -> dict:
    results: dict = {}
    plan = []
    for only in args.only:
        for kind in (args.kinds if only in ("ray", "noray") else [None]):
            if only == "noray" and kind != args.kinds[0]:
                continue  # (the embedded start is the same for every dataset)
            for r in range(args.repeats):
                names = ("torch", "dpex") if r % 2 == 0 else ("dpex", "torch")
                plan += [(only, kind, name) for name in names]
    started = time.perf_counter()
    for step, (only, kind, name) in enumerate(plan, 1):
        key = f"{only}/{kind}" if kind else only
        t = time.perf_counter()
        if only in ("ray", "noray"):
            child = [name, kind, "1" if only == "ray" else "0", str(args.mib)]
            if name == "dpex":
                r = traced(child, args.timeout)
            else:
                r = spawn(child, clean_env(), args.timeout)
            said = f"first batch {r['first_batch_s']:.2f} s"
        elif only == "readme":
            r = timed_script(readme_code(name), args.timeout)
            said = f"{r['wall_s']:.1f} s, {r['cpu_s']:.1f} CPU-s"
        else:
            r = lightning(name, args.timeout)
            said = f"{r['wall_s']:.1f} s, {r['cpu_s']:.1f} CPU-s"
        results.setdefault(key, {}).setdefault(name, []).append(r)
        print(f"[{step}/{len(plan)}] {key}, {name}: {said} ({time.perf_counter() - t:.0f} s, "
              f"{time.perf_counter() - started:.0f} s in all)", file=sys.stderr, flush=True)
    return results


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def tables(results: dict, mib: int) -> str:
    lines = ["| configuration | torch | dpex | dpex - torch | dpex / torch | target | met |",
             "|---|---:|---:|---:|---:|---|---|"]
    for key, runs in results.items():
        for figure, unit in (("first_batch_s", "s"), ("wall_s", "s"), ("cpu_s", "CPU-s")):
            if figure not in runs["dpex"][0]:
                continue
            t = median([r[figure] for r in runs["torch"]])
            d = median([r[figure] for r in runs["dpex"]])
            target, met = target_of(key, figure, t, d)
            name = {"first_batch_s": "first batch", "wall_s": "wall", "cpu_s": "CPU"}[figure]
            lines.append(f"| {describe(key, mib)}: {name} | {t:.2f} {unit} | {d:.2f} {unit} | "
                         f"{d - t:+.2f} | {d / t:.1f}x | {target} | {met} |")
    lines += ["", "Where dpex's first batch went (s after the loader was built; CPU-s of "
              "the process that ran the link):", "",
              "| configuration | " + " | ".join(label for _, label, _, _ in LINKS) + " |",
              "|---|" + "---:|" * len(LINKS)]
    for key, runs in results.items():
        traced_runs = [r for r in runs["dpex"] if "trace" in r]
        if not traced_runs:
            continue
        bars = {b["label"]: b for b in chain(traced_runs[0]["trace"])}
        cells = []
        for _, label, _, _ in LINKS:
            b = bars.get(label)
            cells.append("-" if b is None else f"{b['start']:.2f}-{b['end']:.2f}"
                         + ("" if b["cpu"] is None else f" ({b['cpu']:.2f})"))
        lines.append(f"| {describe(key, mib)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(key: str, mib: int) -> str:
    if key.startswith(("ray/", "noray/")):
        where, kind = key.split("/")
        return (f"{kind} {mib} MiB, "
                + ("Ray running" if where == "ray" else "no Ray (dpex starts it)"))
    return {"readme": "README's example script", "lightning": "a short Lightning fit"}[key]


def target_of(key: str, figure: str, t: float, d: float) -> tuple[str, str]:
    """Issue 50's target for this figure, and whether dpex meets it."""
    if figure == "first_batch_s":
        extra = 3.0 if key.startswith("noray") else 1.5 if key.endswith("strings") else 1.0
        return f"<= torch + {extra:g} s", "yes" if d <= t + extra else "no"
    if key == "readme" and figure == "wall_s":
        return "<= 2x torch", "yes" if d <= 2 * t else "no"
    if key == "lightning":
        ratio = 1.5 if figure == "wall_s" else 2.0
        return f"<= {ratio:g}x torch", "yes" if d <= ratio * t else "no"
    return "", ""


def plot(results: dict, before: dict | None, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"(no matplotlib: no plot at {path})", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(label, key, runs) for label, res in (("before", before), ("now", results))
              if res for key, runs in res.items()
              if any("trace" in r for r in runs.get("dpex", []))]
    if not panels:
        return
    rows = list(dict.fromkeys(row for row, _, _, _ in LINKS))
    colors = dict(zip([label for _, label, _, _ in LINKS],
                      plt.get_cmap("tab10").colors, strict=False))
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.9 * len(panels) + 0.6),
                             sharex=True, squeeze=False)
    for ax, (label, key, runs) in zip(axes[:, 0], panels, strict=True):
        run = next(r for r in runs["dpex"] if "trace" in r)
        for b in chain(run["trace"]):
            y = rows.index(b["row"])
            ax.barh(y, b["end"] - b["start"], left=b["start"], color=colors[b["label"]],
                    height=0.6)
            ax.text(b["start"] + 0.02, y, b["label"], va="center", fontsize=7)
        torch_s = median([r["first_batch_s"] for r in runs["torch"]])
        ax.axvline(run["first_batch_s"], color="black", lw=1)
        ax.axvline(torch_s, color="tab:blue", lw=1, ls="--")
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{label}: {key}: dpex's first batch {run['first_batch_s']:.2f} s "
                     f"(black), torch's {torch_s:.2f} s (dashed)", fontsize=9)
    axes[-1, 0].set_xlabel("seconds after the loader was built")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="dataset size in the trainer")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--only", nargs="+", choices=ONLY, default=list(ONLY),
                   help="which configurations (default: all)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each, alternating")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--before", help="an earlier run's JSON, whose chains are drawn above")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "bench", "cold_start.json"))
    p.add_argument("--replot", action="store_true",
                   help="no runs: the tables and plot again from --out's JSON")
    p.add_argument("--child", nargs=4, metavar=("LOADER", "KIND", "RAY", "MIB"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        name, kind, ray_running, mib = args.child
        print("RESULT " + json.dumps(child_first_batch(name, kind, ray_running == "1",
                                                       int(mib))), flush=True)
        return
    if args.replot:
        with open(args.out) as f:
            saved = json.load(f)
        results, args.mib, args.repeats = saved["results"], saved["args"]["mib"], \
            saved["args"]["repeats"]
    else:
        results = run_all(args)
    print(f"{args.mib} MiB datasets, batch {BATCH}, {WORKERS} persistent workers, the "
          f"loader built and iterated at once, every run a fresh process; "
          f"{os.cpu_count()} cores, {args.repeats} run(s) each (medians)\n")
    print(tables(results, args.mib))
    before = None
    if args.before:
        with open(args.before) as f:
            before = json.load(f)["results"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if not args.replot:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "cores": os.cpu_count(),
                       "args": vars(args), "results": results}, f, indent=1)
    plot(results, before, os.path.splitext(os.path.abspath(args.out))[0] + ".png")


if __name__ == "__main__":
    main()
