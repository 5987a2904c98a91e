"""Signal handlers: no store request on the training thread, earlier handlers still called, forked children
get the handlers from before fabric."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
from test_health_traffic import CountingStore

from fabric.health.job import NEWS_KEY, JobHealth
from fabric.health.preemption import Preemption
from fabric.utilities import _signals


@pytest.fixture(autouse=True)
def _restore_signals() -> Any:
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for signum, handler in before.items():
        _signals._catchers.pop(signum, None)
        _signals._previous.pop(signum, None)
        signal.signal(signum, handler)


def test_the_handler_only_sets_a_flag_and_the_health_thread_announces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_signals.PREEMPTION_SIGNALS_ENV, "TERM")
    store = CountingStore()
    health = JobHealth(store, 0, 2, timedelta(seconds=5))  # not started: this test runs its ticks
    preemption = Preemption()
    preemption.attach(health)
    assert preemption.arm()
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption._signalled.is_set()
    assert sum(store.per_second.values()) == 0, "the handler, on the training thread, made no store request"
    health.tick()
    assert int(store.data[NEWS_KEY]) == 1, "the health thread announced the preemption"
    assert preemption._known


def test_a_handler_installed_before_fabric_is_still_called() -> None:
    calls = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(("earlier", signum)))
    caught = []
    assert _signals.add_catcher(signal.SIGUSR1, caught.append)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert caught == [signal.SIGUSR1]
    assert calls == [("earlier", signal.SIGUSR1)], "submitit's (or the user's) handler still runs"
    _signals.remove_catcher(signal.SIGUSR1, caught.append)


_FORK_SCRIPT = """
import multiprocessing, os, signal, sys, time
from fabric.utilities import _signals

def child(conn):
    conn.send((signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, bool(_signals._catchers)))
    os.kill(os.getpid(), signal.SIGTERM)  # with the parent's handler, this would be caught, not fatal
    time.sleep(5)
    os._exit(3)

if __name__ == "__main__":
    caught = []
    assert _signals.add_catcher(signal.SIGTERM, caught.append)
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=child, args=(sender,))
    process.start()
    default, catchers = receiver.recv()
    process.join(30)
    print(default, catchers, process.exitcode)
"""


def test_a_forked_child_gets_the_handler_from_before_fabric() -> None:
    run = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "False", str(-signal.SIGTERM)]
