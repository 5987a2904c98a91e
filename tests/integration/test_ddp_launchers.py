"""The launchers with 2 real CPU processes over gloo: `ddp` (script re-run), `ddp_spawn`, `ddp_fork`,
`ddp_notebook`, and processes started by torchrun (no launcher)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import _it_runner as runner
import pytest
import torch

from fabric import Fabric
from fabric.environments.default import find_free_port

pytestmark = pytest.mark.multiprocess


def _rank_reports(outdir: Path) -> list[dict]:
    """The reports of every process that ran, ordered by global rank (files are named by pid)."""
    reports = [json.loads(path.read_text()) for path in outdir.glob("rank*_pid*.json")]
    return sorted(reports, key=lambda report: report["global_rank"])


def _seed_123_draws() -> list[float]:
    return torch.rand(4, generator=torch.Generator().manual_seed(123)).tolist()


@pytest.fixture(scope="module")
def addresses() -> list[str]:
    """This machine's non-loopback addresses, on which the store tests probe each job's store."""
    return _non_loopback_addresses()


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory: pytest.TempPathFactory, addresses: list[str]) -> tuple[Path, runner.ScriptRun]:
    """One `ddp` job for its launch test and its store test (each job costs two interpreters)."""
    outdir = tmp_path_factory.mktemp("ddp")
    return outdir, runner.run_script("launch_ddp_script.py", str(outdir), ",".join(addresses), timeout=60)


@pytest.fixture(scope="module")
def launch_function_job(
    tmp_path_factory: pytest.TempPathFactory, addresses: list[str]
) -> Callable[[str], tuple[Path, runner.ScriptRun]]:
    """The `basic` job of a strategy, run once: `ddp_spawn`'s serves its launch test and its store test (a spawn
    job costs three interpreters)."""
    jobs: dict[str, tuple[Path, runner.ScriptRun]] = {}

    def job(strategy: str) -> tuple[Path, runner.ScriptRun]:
        if strategy not in jobs:
            outdir = tmp_path_factory.mktemp(strategy)
            args = [str(outdir), strategy, "basic", ",".join(addresses)]
            jobs[strategy] = outdir, runner.run_script("launch_function.py", *args, timeout=90)
        return jobs[strategy]

    return job


def test_ddp_reruns_the_script_for_rank_1(ddp_job: tuple[Path, runner.ScriptRun], addresses: list[str]) -> None:
    outdir, run = ddp_job
    assert run.returncode == 0, run.output
    reports = _rank_reports(outdir)
    assert [r["global_rank"] for r in reports] == [0, 1], "exactly one process per rank"
    rank0, rank1 = reports
    assert rank0["pid"] == run.pid, "the process we started is rank 0"
    assert rank1["ppid"] == rank0["pid"], "rank 1 is the script re-run by rank 0"
    for rank, report in enumerate(reports):
        assert report["local_rank"] == rank
        assert report["node_rank"] == 0
        assert report["world_size"] == 2
        assert report["device"] == "cpu"
        assert report["is_global_zero"] is (rank == 0)
        assert report["all_reduce_sum"] == [3.0, 30.0]
        assert report["argv"] == [str(outdir), ",".join(addresses)], "the re-run gets the same command-line arguments"


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork", "ddp_notebook"])
def test_launch_function_returns_rank_zero_result(
    launch_function_job: Callable[[str], tuple[Path, runner.ScriptRun]], strategy: str
) -> None:
    outdir, run = launch_function_job(strategy)
    assert run.returncode == 0, run.output
    parent = json.loads((outdir / "parent.json").read_text())
    assert parent["raised"] is None, parent
    ranks = [json.loads((outdir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert parent["result_type"] == "dict"
    assert parent["sum_type"] == "Tensor", "tensors in the result come back as tensors"
    assert parent["result"] == {"rank": 0, "token": "token-5d2", "sum": 3.0, "pid": ranks[0]["pid"]}
    pids = {report["pid"] for report in ranks}
    assert len(pids) == 2 and parent["parent_pid"] not in pids, "fn ran in 2 new processes"
    for rank, report in enumerate(ranks):
        assert report["ppid"] == parent["parent_pid"]
        assert (report["global_rank"], report["local_rank"], report["node_rank"]) == (rank, rank, 0)
        assert report["world_size"] == 2
        assert report["device"] == "cpu"
        assert report["is_global_zero"] is (rank == 0)
        assert report["all_reduce_sum"] == 3.0
        # seed_everything(123) ran in the caller before launch: the workers continue from that RNG state.
        assert report["draws"] == _seed_123_draws()


def test_launch_function_returns_large_result(tmp_path: Path) -> None:
    run = runner.run_script("launch_function.py", str(tmp_path), "ddp_fork", "big", timeout=60)
    parent = json.loads((tmp_path / "parent.json").read_text())
    assert not parent["hung"], "fabric.launch did not return rank 0's 8 MB result within the watchdog's time"
    assert run.returncode == 0, run.output
    assert parent["raised"] is None, parent
    assert parent["result_is_rank0s"]


def test_torchrun_processes_are_used_as_they_are(tmp_path: Path) -> None:
    from fabric.environments.default import find_free_port

    command = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={find_free_port()}",
        str(runner.SCRIPTS / "launch_torchrun.py"),
        str(tmp_path),
    ]
    run = runner.run_python(command, timeout=90)
    assert run.returncode == 0, run.output
    reports = _rank_reports(tmp_path)
    assert [r["global_rank"] for r in reports] == [0, 1], "exactly one process per rank: fabric started none"
    assert len({r["pid"] for r in reports}) == 2
    assert {r["ppid"] for r in reports} == {run.pid}, "both ranks are torchrun's own workers"
    for rank, report in enumerate(reports):
        assert report["launcher"] == "NoneType", "no launcher when the processes already exist"
        assert report["local_rank"] == rank
        assert report["world_size"] == 2, "devices='auto' resolves to LOCAL_WORLD_SIZE"
        assert report["device"] == "cpu"
        assert report["all_reduce_sum"] == 3.0


def _noop(fabric: Fabric) -> None:
    return None


def test_setup_in_the_calling_process_after_launch_fn_says_to_move_it_into_fn() -> None:
    fabric = Fabric(accelerator="cpu", strategy="ddp_fork", devices=2)
    fabric.launch(_noop)
    with pytest.raises(RuntimeError, match=r"fabric\.setup\(\) was called in the process that called fabric\.launch"):
        fabric.setup(torch.nn.Linear(2, 2))


def _non_loopback_addresses() -> list[str]:
    """This machine's own addresses that other hosts could use (not loopback, not link-local)."""
    try:
        words = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        words = []
    found = []
    for word in words:
        with contextlib.suppress(ValueError):
            address = ipaddress.ip_address(word)
            if not (address.is_loopback or address.is_link_local):
                found.append(word)
    return found


@pytest.mark.parametrize("start", ["ddp", "spawn", "fabric_run"])
def test_a_single_machine_job_serves_its_store_on_loopback_only(
    request: pytest.FixtureRequest, tmp_path: Path, addresses: list[str], start: str
) -> None:
    # Whoever reaches the store can set fabric's preemption and abort keys, and stop the job.
    if not addresses:
        pytest.skip("this machine has no non-loopback address to probe the store on")
    if start == "ddp":  # the launch tests' jobs probed their stores too
        outdir, run = request.getfixturevalue("ddp_job")
    elif start == "spawn":
        outdir, run = request.getfixturevalue("launch_function_job")("ddp_spawn")
    else:
        outdir = tmp_path
        script = [str(runner.SCRIPTS / "store_exposure.py"), str(outdir), ",".join(addresses)]
        command = ["-m", "fabric", "run", "--accelerator", "cpu", "--devices", "2", "--main-port",
                   str(find_free_port()), *script]  # fmt: skip
        run = runner.run_python(command, timeout=90)
    assert run.returncode == 0, run.output
    probe = json.loads((outdir / "probe.json").read_text())
    assert probe["results"]["127.0.0.1"] == 0, "the ranks' own address reaches the store"
    reached = [address for address in addresses if probe["results"][address] == 0]
    assert reached == [], f"the store on port {probe['port']} is reachable on {reached}"
