"""The job-health thread: what it does on another rank's failure, and when it lets the store go."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from fabric.environments.default import find_free_port
from fabric.health.job import THREAD_NAME, JobHealth


def test_an_abort_mark_is_noted_but_ends_no_supervised_rank() -> None:
    store = dist.HashStore()
    health = JobHealth(store, 0, 2, timedelta(seconds=5), exit_on_abort=False)
    health.tick()
    assert not health.abort_seen
    JobHealth(store, 1, 2, timedelta(seconds=5)).report_failure()  # rank 1 raised
    health.tick()
    assert health.abort_seen, "a launcher's signal that follows is taken for the job's end, not a preemption"


_UNSUPERVISED = """
from datetime import timedelta
import torch.distributed as dist
from fabric.health.job import JobHealth

store = dist.HashStore()
health = JobHealth(store, 0, 2, timedelta(seconds=5), exit_on_abort=True)
JobHealth(store, 1, 2, timedelta(seconds=5)).report_failure()
health.tick()
print("not ended")
"""


def test_an_abort_mark_ends_an_unsupervised_rank_with_a_message() -> None:
    run = subprocess.run([sys.executable, "-c", _UNSUPERVISED], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout
    assert "[fabric] Global rank 1 failed (its error is in its output), so global rank 0 ends too" in run.stderr


def test_the_thread_lets_the_store_go_when_the_user_destroys_the_group() -> None:
    store = dist.TCPStore("127.0.0.1", find_free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    health = JobHealth(store, 0, 2, timedelta(seconds=10), group=dist.group.WORLD)
    health.start()
    thread = next(thread for thread in threading.enumerate() if thread.name == THREAD_NAME)
    dist.destroy_process_group()
    deadline = time.monotonic() + 30
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not thread.is_alive(), "the thread stops on its own"
    assert health.store is None and health._conn is None, "and drops its connections (rank 0's is the server)"
