"""The job's store traffic from the health threads: counted per simulated second, for up to 4096 ranks.

No threads and no wall clock: each simulated rank's tick runs at the times its JobHealth schedules (its first
delay, then every tick_seconds), against one counting store that stands for the job's single store server.
"""

from __future__ import annotations

import heapq
import math
import signal
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

from fabric.diagnostics.record import CollectiveRecorder
from fabric.health.job import JobHealth, tick_seconds
from fabric.health.preemption import Preemption

BOUND = 500  # requests per second for the whole job (the bound at 4096 ranks)


class CountingStore:
    """A dict with the store methods the health thread uses; counts each request at the simulated time `now`."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.now = 0.0
        self.per_second: Counter[int] = Counter()

    def _count(self) -> None:
        self.per_second[math.floor(self.now)] += 1

    def clone(self) -> CountingStore:
        return self

    def set(self, key: str, value: str) -> None:
        self._count()
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        self._count()
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        self._count()
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        self._count()
        return all(key in self.data for key in keys)


class _Group:
    """Stands for a process group."""


def _simulate(world_size: int, seconds: float, signal_at: float | None = None) -> tuple[CountingStore, list[Any]]:
    store = CountingStore()
    group = _Group()
    ranks = []
    for rank in range(world_size):
        health = JobHealth(store, rank, world_size, timedelta(minutes=30))
        health.adopt(CollectiveRecorder(store, rank, world_size, group, debug=False))
        preemption = Preemption()
        preemption.attach(health)
        ranks.append((health, preemption))
    store.per_second.clear()  # each record's first publication, at setup: once per job, like the rendezvous
    due = [(health.first_delay, rank) for rank, (health, _) in enumerate(ranks)]
    heapq.heapify(due)
    signalled = signal_at is None
    while due[0][0] < seconds:
        store.now, rank = heapq.heappop(due)
        if not signalled and store.now >= signal_at:
            ranks[world_size // 2][1]._catch(signal.SIGTERM)  # a handler: no request; the next tick announces it
            signalled = True
        health = ranks[rank][0]
        health.tick()
        heapq.heappush(due, (store.now + health.tick_seconds, rank))
    return store, ranks


@pytest.mark.parametrize("world_size", [2, 64, 1024, 4096])
def test_store_traffic_stays_within_the_bound_whatever_the_job_size(world_size: int) -> None:
    period = tick_seconds(world_size)
    store, ranks = _simulate(world_size, seconds=4 * period, signal_at=1.5 * period)
    assert max(store.per_second.values()) <= BOUND, "a preemption's news included"
    assert all(preemption._known for _, preemption in ranks), "every rank learned of the preemption"
    assert all(record.beat >= 3 for record in _records(store, world_size)), "every rank kept publishing"


def test_a_small_job_ticks_five_times_a_second_with_two_requests_each() -> None:
    store, _ = _simulate(2, seconds=10)
    assert tick_seconds(2) == pytest.approx(0.2)
    assert sum(store.per_second.values()) == pytest.approx(2 * 2 * 5 * 10, abs=4)  # 2 ranks, 2 requests, 5 ticks


def test_the_tick_of_a_large_job_is_long_enough_for_the_bound() -> None:
    # The whole job's steady traffic: world_size ranks, 2 requests each per tick.
    assert 2 * 4096 / tick_seconds(4096) <= BOUND
    store, _ = _simulate(4096, seconds=3 * tick_seconds(4096))
    assert max(store.per_second.values()) <= BOUND


def _records(store: CountingStore, world_size: int) -> list[Any]:
    from fabric.diagnostics.record import PeerRecord, record_key

    return [PeerRecord.decode(rank, store.data[record_key(rank)]) for rank in range(world_size)]
