"""Errors raised where torch raises them, and clear errors for bad set-ups."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import dsets
import pytest
import ray

from dpex import DatasetNotPicklableError, DpexDataLoader, WorkerStartupError
from dpex.errors import BatchTooLargeError

# dpex's workers in this process (tests/inprocess.py) unless a test is marked `ray`: a
# worker that sleeps or blocks, a node's address, a module the workers cannot import.
pytestmark = [pytest.mark.usefixtures("dpex_workers"), pytest.mark.timeout(120)]
ON_RAY = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def take_until_error(loader):
    got = []
    it = iter(loader)
    with pytest.raises(Exception) as err:
        for batch in it:
            got.append(batch)
    return got, err.value


@ON_RAY
def test_worker_exception_is_raised_at_torchs_point_with_torchs_type():
    kw = {"batch_size": 2, "num_workers": 2}
    theirs, their_err = take_until_error(dsets.torch_loader(dsets.FailsAt(9), **kw))
    loader = DpexDataLoader(dsets.FailsAt(9), distribute_mode=True, **kw)
    ours, our_err = take_until_error(loader)
    assert len(ours) == len(theirs) == 4
    assert type(our_err) is type(their_err) is ValueError
    msg = str(our_err)
    assert msg.startswith("Caught ValueError in DataLoader worker process 0")
    node_ip = ray.nodes()[0]["NodeManagerAddress"]
    assert "indices [8, 9]" in msg and f"on node {node_ip}" in msg and "bad index 9" in msg
    # The loader can be iterated again: a fresh iterator, the same story.
    again, again_err = take_until_error(loader)
    assert len(again) == 4 and isinstance(again_err, ValueError)


def test_worker_init_fn_exception_is_raised_on_the_first_batch():
    loader = DpexDataLoader(dsets.Squares(10), batch_size=2, num_workers=2,
                            worker_init_fn=dsets.failing_init, distribute_mode=True)
    got, err = take_until_error(loader)
    assert got == [] and isinstance(err, ZeroDivisionError)
    assert "Caught ZeroDivisionError in DataLoader worker process 0" in str(err)


@ON_RAY
def test_timeout_counts_batches_not_worker_start_up():
    loader = DpexDataLoader(dsets.Slow(delay=3.0), batch_size=1, num_workers=1, timeout=1.0,
                            distribute_mode=True)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 1.0 seconds"):
        next(iter(loader))
    assert time.monotonic() - t0 < 30


@ON_RAY
def test_timeout_longer_than_the_liveness_poll_is_honoured_in_full(monkeypatch):
    from dpex.client import _driver

    monkeypatch.setattr(_driver, "_POLL_S", 0.3)  # the loop-liveness wake-up
    loader = DpexDataLoader(dsets.Slow(delay=20.0), batch_size=1, num_workers=1, timeout=1.5,
                            distribute_mode=True)
    it = iter(loader)
    while len(it._ready) < 1:  # start-up is not part of the timeout
        it._driver.receive_one()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 1.5 seconds"):
        next(it)
    assert 1.5 <= time.monotonic() - t0 < 5
    it._shutdown_workers()


class Locked(dsets.Squares):
    def __init__(self):
        super().__init__(4)
        self.lock = threading.Lock()


def test_unpicklable_dataset_names_its_type_and_attribute():
    loader = DpexDataLoader(Locked(), num_workers=1, distribute_mode=True)
    with pytest.raises(DatasetNotPicklableError) as err:
        iter(loader)
    assert "Locked" in str(err.value) and "dataset.lock" in str(err.value)


@ON_RAY
def test_dataset_from_a_module_workers_cannot_import_says_how_to_ship_it(tmp_path, monkeypatch):
    (tmp_path / "dpex_far_module.py").write_text(
        "import torch\n"
        "class FarAway(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 4\n"
        "    def __getitem__(self, i): return i\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import dpex_far_module

    loader = DpexDataLoader(dpex_far_module.FarAway(), num_workers=1, distribute_mode=True)
    with pytest.raises(WorkerStartupError) as err:
        list(loader)
    assert "cannot import module 'dpex_far_module'" in str(err.value)
    assert "register_pickle_by_value" in str(err.value)


def run_python(code, timeout=90, env=None):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | (env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.subprocess
def test_unreachable_head_address_names_it_quickly():
    t0 = time.monotonic()
    proc = run_python("""
        import torch
        from dpex import DpexDataLoader, RayConnectionError
        loader = DpexDataLoader(torch.arange(4), num_workers=1, distribute_mode=True,
                                head_address="127.0.0.1:1")
        try:
            iter(loader)
        except RayConnectionError as e:
            print("ERR", e)
    """)
    assert "ERR cannot reach the Ray cluster at head_address='127.0.0.1:1'" in proc.stdout, proc.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.subprocess
def test_unreachable_ray_address_variable_is_not_replaced_by_a_local_ray():
    proc = run_python("""
        import ray, torch
        from dpex import DpexDataLoader, RayConnectionError
        try:
            iter(DpexDataLoader(torch.arange(4), num_workers=1, distribute_mode=True))
        except RayConnectionError as e:
            print("ERR", e)
        print("RAY", ray.is_initialized())
    """, env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert "ERR cannot reach the Ray cluster at RAY_ADDRESS='127.0.0.1:1'" in proc.stdout, proc.stderr
    assert "RAY False" in proc.stdout


FIRST_SCRIPT = """
    import os, sys, time, ray, torch
    from dpex import DpexDataLoader
    loader = DpexDataLoader(torch.arange(10), batch_size=4, num_workers=2, distribute_mode=True)
    batches = [b.tolist() for b in loader]
    print("GCS", ray.get_runtime_context().gcs_address, flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    print("BATCHES", batches)
    print("RAY", ray.is_initialized())
"""

SECOND_SCRIPT = """
    import os, sys, time, ray, torch
    from dpex import DpexDataLoader
    loader = DpexDataLoader(torch.arange(10), batch_size=5, num_workers=2, distribute_mode=True,
                            persistent_workers=True)
    assert len(list(loader)) == 2
    print("GCS", ray.get_runtime_context().gcs_address, flush=True)
    open(sys.argv[1], "w").close()  # the first script may end now
    deadline = time.monotonic() + 120
    while not os.path.exists(sys.argv[2]):  # ... and has ended (the test says so)
        assert time.monotonic() < deadline, "the first script did not end"
        time.sleep(0.05)
    print("AFTER", [b.tolist() for b in loader], flush=True)
    loader.close()
"""


@pytest.mark.subprocess
def test_the_embedded_default_starts_ray_and_a_second_script_gets_its_own(tmp_path):
    """With no Ray running, dpex starts a local one (the embedded default) and the
    loader gives torch's batches; another script's embedded Ray is not a cluster to
    join: it ends with that script, and the second outlives it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    flag, ended = str(tmp_path / "first-may-end"), str(tmp_path / "first-ended")

    def start(code, *args):
        return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=ROOT)

    first = start(FIRST_SCRIPT, flag)
    try:
        line = first.stdout.readline()  # the first script's Ray is up and its loader ran
        assert line.startswith("GCS"), first.stderr.read()[-3000:]
        second = start(SECOND_SCRIPT, flag, ended)
        assert first.wait(120) == 0
        rest = first.stdout.read()
        assert "BATCHES [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]" in rest, first.stderr.read()[-3000:]
        assert "RAY True" in rest
        open(ended, "w").close()
        out, err = second.communicate(timeout=150)
    finally:
        first.kill()
    assert second.returncode == 0, err[-3000:]
    gcs = [ln.split()[1] for ln in out.splitlines() if ln.startswith("GCS")]
    assert gcs and gcs[0] != line.split()[1]
    assert "AFTER [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]" in out


@ON_RAY
def test_slow_worker_init_fn_is_not_a_start_up_failure():
    """As in torch, worker_init_fn runs before the first batch; it is not actor start-up."""
    # Starting the node's host (an actor, its forkserver) takes 1-4 s here and, beside
    # another test process, once over 12 s (a CI run): a first loader leaves it warm, so
    # the start timed below is a fork; the worker_init_fn outlasts startup_timeout.
    assert len(list(DpexDataLoader(dsets.Squares(4), batch_size=2, num_workers=1,
                                   distribute_mode=True))) == 2
    loader = DpexDataLoader(dsets.Squares(4), batch_size=2, num_workers=1, startup_timeout=12,
                            worker_init_fn=dsets.SleepyInit(13), distribute_mode=True)
    assert len(list(loader)) == 2


def test_a_batch_over_max_message_bytes_is_an_error_in_its_slot():
    loader = DpexDataLoader(dsets.Squares(8), batch_size=2, num_workers=2, timeout=30,
                            collate_fn=dsets.big_for_batch_1, max_message_bytes=64 * 1024,
                            distribute_mode=True)
    got, err = take_until_error(loader)
    assert len(got) == 1 and isinstance(err, BatchTooLargeError)
    assert "batch 1 is" in str(err) and "max_message_bytes=65,536" in str(err)
    assert "Caught BatchTooLargeError in DataLoader worker process 1" in str(err)


def test_dataset_returning_device_tensors_gets_a_clear_error():
    loader = DpexDataLoader(dsets.OnDevice(4), batch_size=2, num_workers=1, distribute_mode=True)
    got, err = take_until_error(loader)
    # dpex's own check says so (TypeError; torch 2.13); an older torch (2.1, 2.6) already
    # fails to collate such tensors (RuntimeError). Either way: in the batch's slot, named.
    assert got == [] and isinstance(err, (TypeError, RuntimeError))
    assert f"Caught {type(err).__name__} in DataLoader worker process 0" in str(err)
    assert "meta" in str(err)


def test_worker_with_other_versions_is_refused_at_handshake(monkeypatch):
    from dpex.client import _driver

    real = _driver.local_versions()
    monkeypatch.setattr(_driver, "local_versions", lambda: {**real, "dpex": "9.9.9"})
    loader = DpexDataLoader(dsets.Squares(4), batch_size=2, num_workers=1,
                            distribute_mode=True)
    with pytest.raises(WorkerStartupError, match=r"runs .*'dpex': '0\.1\.0'.* but this trainer "
                       r"runs .*'dpex': '9\.9\.9'.*install the same Python and dpex"):
        list(loader)


def test_unpicklable_collate_fn_names_itself_and_the_failing_part():
    lock = threading.Lock()

    def collate(items):
        with lock:
            return items

    loader = DpexDataLoader(dsets.Squares(4), num_workers=1, collate_fn=collate,
                            distribute_mode=True)
    with pytest.raises(DatasetNotPicklableError, match=r"the collate_fn .*cannot be pickled"):
        iter(loader)
