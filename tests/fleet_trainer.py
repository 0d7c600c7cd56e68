"""A trainer attached to a fleet (run by tests/test_fleet.py in its own process).

Reads --epochs epochs of a dataset through DpexDataLoader(worker_pool=...) and
through torch's DataLoader with the same arguments, checks they are identical,
and prints one JSON line: {"ok": true, "stats": ...}. --cut-link takes a network
link down mid-epoch (tests/test_multihost.py). --kill-after N kills the
process of this loader's worker 1 (--kill: the fleet worker's, or its session's)
after N batches of the first epoch; --stall
stops reading after 3 batches and sleeps (to be killed); --hang reads a dataset
that hangs in its workers after 2 batches (prints HUNG, to be killed);
--resume-at N saves the loader's state after N batches of the first epoch and goes
on with a new loader that loads it (a preempted trainer, resumed).
--scale-to AFTER:N changes the worker count mid-epoch; --wait-file F pauses after 2
batches until F exists (a test changes the fleet meanwhile); --dataset slowstop with
--slow-flag F: once F exists, the first fetch of the logical worker it names takes 8 s
(a session that needs seconds to stop).
The JSON line also gives the longest wait for one batch.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

import cloudpickle
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsets  # noqa: E402

from dpex import DpexDataLoader  # noqa: E402

cloudpickle.register_pickle_by_value(dsets)


class SlowOnce(dsets.Squares):
    """Squares; once ``flag`` exists, the first fetch of the logical worker whose id it
    holds takes ``hold`` seconds (once in all: a ``.done`` file marks it taken)."""

    def __init__(self, n: int, flag: str, hold: float = 8.0) -> None:
        super().__init__(n, max_sleep=0.0)
        self.flag, self.hold = flag, hold

    def __getitem__(self, i: int):
        info = torch.utils.data.get_worker_info()
        if os.path.exists(self.flag) and not os.path.exists(self.flag + ".done"):
            with open(self.flag) as f:
                mine = f.read().strip() == str(info.id)
            if mine:
                open(self.flag + ".done", "w").close()
                time.sleep(self.hold)
        return super().__getitem__(i)

class AsksNamedActor(dsets.Squares):
    """Squares, each item plus what this trainer's named actor answers: a fleet session
    finds the actor only in the trainer's namespace."""

    ACTOR = "dpex-test-answer"

    def __getitem__(self, i: int):
        import ray

        row, n = super().__getitem__(i)
        return row + ray.get(ray.get_actor(self.ACTOR).value.remote()), n


def _answer_class():
    import ray

    @ray.remote(num_cpus=0)
    class Answer:
        def value(self) -> int:
            return 1000

    return Answer


Answer = None if __name__ != "__main__" else _answer_class()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--fleet", required=True)
    p.add_argument("--dataset", choices=["probe", "squares", "images", "slowstop", "named"],
                   default="probe")
    p.add_argument("--cut-link", default=None,
                   help="VETH:AFTER:SECONDS: after AFTER batches, take VETH down for SECONDS")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--kill-after", type=int, default=None)
    p.add_argument("--kill", choices=["pid", "session_pid"], default="pid",
                   help="what --kill-after kills: the fleet worker, or only the session's process")
    p.add_argument("--stall", action="store_true")
    p.add_argument("--hang", action="store_true")
    p.add_argument("--resume-at", type=int, default=None)
    p.add_argument("--scale-to", default=None,
                   help="AFTER:N: after AFTER batches of the first epoch, scale_workers(N)")
    p.add_argument("--step-s", type=float, default=0.0, help="the loop's time per batch")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--no-backups", action="store_true",
                   help="straggler_timeout=None: a slow batch is waited for, not backed up")
    p.add_argument("--slow-flag", default=None, help="--dataset slowstop's flag file")
    p.add_argument("--wait-file", default=None,
                   help="print WAITING after 2 batches and wait for this file to exist")
    args = p.parse_args()
    if args.hang:
        hang(args)
        return

    dataset = {"probe": dsets.SeedProbe, "images": lambda: dsets.Images(48),
               "squares": lambda: dsets.Squares(160, max_sleep=0.01),
               "slowstop": lambda: SlowOnce(160, args.slow_flag),
               "named": lambda: AsksNamedActor(32)}[args.dataset]()
    kw = {"batch_size": 4, "num_workers": 2, "shuffle": True, "persistent_workers": True}
    if args.dataset == "named":  # this trainer's named actor, in its own namespace
        from dpex._ray_connect import connect_ray

        connect_ray(args.address)
        answer = Answer.options(name=AsksNamedActor.ACTOR).remote()  # noqa: F841 (kept)
    reference = (dict(kw, num_workers=0, persistent_workers=False)  # (Ray is here)
                 if args.dataset == "named" else kw)
    expected = dsets.epochs(dsets.torch_loader(dataset, generator=torch.Generator().manual_seed(7),
                                               **reference), args.epochs)

    def make() -> DpexDataLoader:
        return DpexDataLoader(dataset, generator=torch.Generator().manual_seed(7),
                              distribute_mode=True, head_address=args.address,
                              worker_pool=args.fleet, max_worker_restarts=args.max_restarts,
                              **({"straggler_timeout": None} if args.no_backups else {}), **kw)

    loader = make()
    epoch_s, longest_wait = [], 0.0
    try:
        for epoch, want in enumerate(expected):
            got, t0 = [], time.monotonic()
            last = t0
            for batch in loader:
                got.append(batch)
                if epoch == 0 and len(got) == args.resume_at:
                    state = loader.state_dict()
                    loader.close()
                    loader = make()
                    loader.load_state_dict(state)
                    break
                longest_wait, last = max(longest_wait, time.monotonic() - last), time.monotonic()
                if args.stall and len(got) == 3:
                    print("STALLED", json.dumps(loader.stats()["workers"]), flush=True)
                    time.sleep(600)
                if epoch == 0 and args.cut_link and len(got) == int(args.cut_link.split(":")[1]):
                    veth, _, seconds = args.cut_link.split(":")
                    subprocess.run(["ip", "link", "set", veth, "down"], check=True)
                    threading.Timer(float(seconds), subprocess.run,
                                    (["ip", "link", "set", veth, "up"],)).start()
                    print("CUT", flush=True)
                if epoch == 0 and args.scale_to and len(got) == int(args.scale_to.split(":")[0]):
                    loader.scale_workers(int(args.scale_to.split(":")[1]))
                if epoch == 0 and args.wait_file and len(got) == 2:
                    print("WAITING", json.dumps(loader.stats()["workers"]), flush=True)
                    deadline = time.monotonic() + 120
                    while not os.path.exists(args.wait_file) and time.monotonic() < deadline:
                        time.sleep(0.1)
                time.sleep(args.step_s)
                if epoch == 0 and len(got) == args.kill_after:
                    os.kill(loader.stats()["workers"][1][args.kill], signal.SIGKILL)
            if epoch == 0 and args.resume_at:
                got += list(loader)
            epoch_s.append(time.monotonic() - t0)
            assert len(got) == len(want), (len(got), len(want))
            for g, w in zip(got, want, strict=True):
                dsets.assert_same(g, w)
        stats = loader.stats()
    finally:
        loader.close()
    print(json.dumps({"ok": True, "stats": stats, "epoch_s": epoch_s,
                      "longest_wait_s": longest_wait}), flush=True)


def hang(args: argparse.Namespace) -> None:
    """Both workers' fetches hang (for 120 s) from the third batch on."""
    loader = DpexDataLoader(dsets.HangsFrom(8, hold=120.0), batch_size=4, num_workers=2,
                            distribute_mode=True, head_address=args.address,
                            worker_pool=args.fleet)
    for n, _ in enumerate(loader, 1):
        if n == 2:
            print("HUNG", json.dumps(loader.stats()["workers"]), flush=True)


if __name__ == "__main__":  # torch's forkserver workers import this file
    main()
