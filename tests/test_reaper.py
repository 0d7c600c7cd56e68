"""Teardown of dropped objects runs on dpex's reaper thread, and never in a forked child."""

import os
import threading
import time

import pytest

from dpex._reaper import finalizer_for

pytestmark = pytest.mark.timeout(60)


def test_a_finalizer_run_on_a_foreign_thread_tears_down_on_the_reaper_thread():
    ran = []
    done = threading.Event()

    def close():
        ran.append(threading.current_thread().name)
        done.set()

    finalize = finalizer_for(close)
    foreign = threading.Thread(target=finalize, name="ray-like-thread")
    foreign.start()
    foreign.join(5)
    assert done.wait(5) and ran == ["dpex-reaper"]


@pytest.mark.subprocess
def test_a_forked_childs_copy_tears_down_nothing():
    read, write = os.pipe()

    def close():
        os.write(write, b"closed")

    finalize = finalizer_for(close)
    pid = os.fork()
    if pid == 0:  # the child: finalize its copy, give a reaper time to run, report
        try:
            finalize()
            time.sleep(0.5)
            os.write(write, b"done")
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        assert f.read() == b"done" and os.waitstatus_to_exitcode(status) == 0
