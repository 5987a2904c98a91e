"""A launched Fabric of one CPU process, for the fixtures of tests that need a real process group."""

from __future__ import annotations

from collections.abc import Iterator

from fabric import Fabric


def one_process(strategy: str) -> Iterator[Fabric]:
    """For a fixture (`yield from`): a launched Fabric of one CPU process under `strategy`, a real gloo group with
    its recorder and job-health thread, torn down after the test."""
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=1)
    fabric.launch()
    yield fabric
    fabric.strategy.teardown()
