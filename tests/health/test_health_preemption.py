"""`fabric.preempted` without processes: the agreement through a store, the signal catching, the callbacks."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from test_health_traffic import CountingStore

from fabric import Fabric
from fabric.health.job import ABORT_STEP, NEWS_KEY, JobHealth
from fabric.health.preemption import Preemption
from fabric.utilities import _signals


def _attached(store: Any, rank: int, timeout: float) -> tuple[Preemption, JobHealth]:
    health = JobHealth(store, rank, 2, timedelta(seconds=timeout))
    preemption = Preemption()
    preemption.attach(health)
    health.start()
    return preemption, health


@pytest.fixture(autouse=True)
def _restore_signals() -> Any:
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for signum, handler in before.items():
        _signals._catchers.pop(signum, None)
        signal.signal(signum, handler)


def _wait_until(condition: Any) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the background thread did not act"
        time.sleep(0.01)


def test_ranks_stop_at_the_same_check_whoever_was_signalled() -> None:
    store = dist.HashStore()
    attached = [_attached(store, rank, 10) for rank in range(2)]
    ranks = [preemption for preemption, _ in attached]
    try:
        # Rank 1 runs ahead: 5 checks, rank 0 only 2, when rank 0 gets the signal.
        assert [ranks[1].check() for _ in range(5)] == [False] * 5
        assert [ranks[0].check() for _ in range(2)] == [False] * 2
        ranks[0]._catch(signal.SIGTERM)
        _wait_until(lambda: ranks[0]._known and ranks[1]._known)
        answers0 = [ranks[0].check() for _ in range(6)]
        answers1 = [ranks[1].check() for _ in range(3)]
    finally:
        for preemption, health in attached:
            preemption.detach()
            health.stop()
    # Both answer True at their 6th check, the one after the most checks any rank had answered False.
    assert answers0 == [False, False, False, True, True, True]
    assert answers1 == [True, True, True]


def test_a_silent_rank_makes_the_agreement_fail_with_a_clear_error() -> None:
    store = dist.HashStore()
    alone, health = _attached(store, 0, 0.3)
    try:
        alone._catch(signal.SIGTERM)
        _wait_until(lambda: alone._known)
        with pytest.raises(RuntimeError, match=r"the job was preempted, but rank\(s\) \[1\] did not answer within"):
            alone.check()
    finally:
        alone.detach()
        health.stop()


def test_signal_after_the_first_read_becomes_the_flag_and_calls_on_preempt() -> None:
    calls = []

    class Saver:
        def on_preempt(self, fabric: Fabric) -> None:
            calls.append(fabric)

    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[Saver()])
    assert fabric.preempted is False  # the first read starts catching the signal
    os.kill(os.getpid(), signal.SIGTERM)
    _wait_until(lambda: fabric.strategy.preemption._signalled.is_set())
    assert fabric.preempted is True
    assert fabric.preempted is True
    assert calls == [fabric], "on_preempt runs once, with the fabric"


class _OnPreempt:
    def on_preempt(self) -> None:
        raise AssertionError("never preempted here")


def test_sigterm_keeps_its_default_effect_until_preempted_is_read() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[_OnPreempt()])
    fabric.launch()
    assert signal.getsignal(signal.SIGTERM) is not _signals._dispatch, "a callback alone does not catch it"
    assert fabric.preempted is False
    assert signal.getsignal(signal.SIGTERM) is _signals._dispatch


def test_preemption_signals_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv(_signals.PREEMPTION_SIGNALS_ENV, raising=False)
    assert _signals.preemption_signals() == (signal.SIGTERM,)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert _signals.preemption_signals() == (signal.SIGTERM, signal.SIGUSR1)
    monkeypatch.setenv(_signals.PREEMPTION_SIGNALS_ENV, "usr2, SIGTERM")
    assert _signals.preemption_signals() == (signal.SIGUSR2, signal.SIGTERM)
    monkeypatch.setenv(_signals.PREEMPTION_SIGNALS_ENV, "")
    assert _signals.preemption_signals() == ()


@pytest.mark.parametrize("name", ["KILL", "INT", "NOPE"])
def test_unusable_preemption_signal_is_rejected(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(_signals.PREEMPTION_SIGNALS_ENV, f"TERM,{name}")
    with pytest.raises(ValueError, match=rf"FABRIC_PREEMPTION_SIGNALS='TERM,{name}': '{name}' cannot announce"):
        _signals.preemption_signals()


_CATCH_SCRIPT = """
import os, signal, sys, time
from datetime import timedelta
import torch.distributed as dist
from fabric.health.job import JobHealth
from fabric.health.preemption import Preemption

store = dist.HashStore()
health = JobHealth(store, 0, 2, timedelta(seconds=5))
preemption = Preemption()
preemption.attach(health)
health.start()
preemption.arm()
if sys.argv[1] == "failing":  # what a failing rank leaves before the launcher ends the others
    JobHealth(store, 1, 2, timedelta(seconds=5)).report_failure()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(1)
print("flag", preemption._signalled.is_set())
preemption.detach()
health.stop()
"""


@pytest.mark.parametrize(("job", "returncode", "output"), [("healthy", 0, "flag True"), ("failing", -15, "")])
def test_sigterm_is_a_preemption_only_while_no_rank_has_failed(job: str, returncode: int, output: str) -> None:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _CATCH_SCRIPT, job], capture_output=True, text=True, timeout=120)
    assert run.returncode == returncode, run.stderr
    assert run.stdout.strip() == output


class _LateFailureStore(CountingStore):
    """A store in which a rank fails, and the launcher signals this one, just after a news read.

    The launcher's order: the failed rank leaves its abort mark, then the others get SIGTERM. Both land between
    the health thread's read of the news and its handling of this rank's signal, the race the thread must win.
    """

    def __init__(self, preemption: Preemption) -> None:
        super().__init__()
        self.preemption = preemption
        self.failed = False

    def add(self, key: str, amount: int) -> int:
        value = super().add(key, amount)
        if key == NEWS_KEY and amount == 0 and not self.failed:  # a read of the news
            self.failed = True
            JobHealth(self, 1, 2, timedelta(seconds=5)).report_failure()
            self.preemption._catch(signal.SIGTERM)  # what the signal handler runs
        return value


def test_a_signal_caught_just_after_the_news_was_read_is_judged_by_the_next_read(monkeypatch: Any) -> None:
    preemption = Preemption()
    store = _LateFailureStore(preemption)
    health = JobHealth(store, 0, 2, timedelta(seconds=5))
    preemption.attach(health)
    killed: list[int] = []
    monkeypatch.setattr(signal, "pthread_kill", lambda thread, signum: killed.append(signum))
    health.tick()  # read the news (nothing yet); then the failure and the signal
    assert int(store.data[NEWS_KEY]) == ABORT_STEP, "the signal was not announced as a preemption"
    assert killed == [] and not health.request_seen
    health.tick()  # the next tick sees the failure: the signal came with it
    assert health.abort_seen and killed == [signal.SIGTERM], "the rank dies of the launcher's signal"
    assert int(store.data[NEWS_KEY]) == ABORT_STEP and preemption.check() is False


def test_two_fabrics_in_one_process_both_see_the_signal() -> None:
    first, second = Fabric(accelerator="cpu", devices=1), Fabric(accelerator="cpu", devices=1)
    assert (first.preempted, second.preempted) == (False, False)
    os.kill(os.getpid(), signal.SIGTERM)
    _wait_until(lambda: second.strategy.preemption._signalled.is_set())
    assert (first.preempted, second.preempted) == (True, True)
