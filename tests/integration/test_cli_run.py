"""`fabric run` with real processes: 2 CPU ranks, `python -m fabric`, two nodes over loopback, and failures."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import _it_runner as runner
import pytest

pytestmark = pytest.mark.multiprocess

FABRIC = [sys.executable, "-c", "import sys; from fabric.cli import main; sys.exit(main())"]
_console_script = Path(sys.executable).parent / "fabric"
if _console_script.exists():  # the installed console script, as users run it
    FABRIC = [str(_console_script)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=runner.script_env(),
        cwd=runner.SCRIPTS,
        start_new_session=True,  # its own process group, so a timeout ends torchrun and every worker
    )


def _finish(proc: subprocess.Popen, deadline: float) -> tuple[int, str, str]:
    """Wait until DEADLINE (time.monotonic()); on timeout end the group and fail. Leaves no process behind."""
    try:
        stdout, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        runner.end_group(proc.pid)
        stdout, stderr = proc.communicate(timeout=10)
        pytest.fail(f"{' '.join(proc.args)} did not finish in time\n--- stdout\n{stdout}\n--- stderr\n{stderr}")  # type: ignore[arg-type]
    finally:
        runner.end_group(proc.pid)
    return proc.returncode, stdout, stderr


def _run(command: list[str], timeout: float = 60) -> tuple[int, str, str]:
    return _finish(_start(command), time.monotonic() + timeout)


def _reports(outdir: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in outdir.glob("rank*.json")), key=lambda r: r["global_rank"])


def _check_two_ranks(outdir: Path, argv_tail: list[str]) -> None:
    reports = _reports(outdir)
    assert [r["global_rank"] for r in reports] == [0, 1]
    for rank, report in enumerate(reports):
        assert (report["local_rank"], report["node_rank"], report["world_size"]) == (rank, 0, 2)
        assert report["strategy"] == "DDPStrategy"
        assert report["all_reduce_sum"] == 3.0
        assert report["samples"] == list(range(rank, 64, 2))
        assert report["argv"] == [str(outdir), *argv_tail]


def test_two_cpu_ranks_without_launch(tmp_path: Path) -> None:
    port = str(_free_port())
    argv = ["run", "--accelerator", "cpu", "--devices", "2", "--main-port", port, "cli_report.py", str(tmp_path)]
    code, _, err = _run([*FABRIC, *argv, "--lr", "0.1", "--", "--devices", "3"])
    assert code == 0, err
    _check_two_ranks(tmp_path, ["--lr", "0.1", "--devices", "3"])
    env = _reports(tmp_path)[0]["cli_env"]
    assert env == {
        "FABRIC_CLI_ACCELERATOR": "cpu",
        "FABRIC_CLI_STRATEGY": "auto",
        "FABRIC_CLI_DEVICES": "2",
        "FABRIC_CLI_NUM_NODES": "1",
    }


def test_options_after_the_script_as_in_lightning(tmp_path: Path) -> None:
    """Lightning's form: `fabric run train.py --devices 2 --precision bf16-mixed`; the rest is the script's."""
    port = str(_free_port())
    argv = ["run", "cli_report.py", str(tmp_path), "--accelerator", "cpu", "--devices", "2", "--lr", "0.1"]
    argv += ["--precision", "bf16-mixed", "--main-port", port, "--", "--devices", "3"]
    code, _, err = _run([*FABRIC, *argv])
    assert code == 0, err
    _check_two_ranks(tmp_path, ["--lr", "0.1", "--devices", "3"])
    assert {r["precision"] for r in _reports(tmp_path)} == {"MixedPrecision"}
    assert _reports(tmp_path)[0]["cli_env"]["FABRIC_CLI_PRECISION"] == "bf16-mixed"


def test_python_dash_m_fabric_with_launch(tmp_path: Path) -> None:
    port = str(_free_port())
    argv = ["run", "--accelerator", "cpu", "--devices", "2", "--main-port", port, "cli_report.py", str(tmp_path)]
    code, _, err = _run([sys.executable, "-m", "fabric", *argv, "launch"])
    assert code == 0, err
    _check_two_ranks(tmp_path, ["launch"])


def test_two_nodes_over_loopback(tmp_path: Path) -> None:
    port = str(_free_port())
    common = ["run", "--accelerator", "cpu", "--devices", "2", "--num-nodes", "2", "--main-address", "127.0.0.1"]
    common += ["--main-port", port]
    deadline = time.monotonic() + 75
    nodes = [_start([*FABRIC, *common, "--node-rank", str(n), "cli_report.py", str(tmp_path)]) for n in (0, 1)]
    try:
        results = [_finish(proc, deadline) for proc in nodes]
    finally:
        for proc in nodes:
            runner.end_group(proc.pid)
    for code, _, err in results:
        assert code == 0, err
    reports = _reports(tmp_path)
    assert [r["global_rank"] for r in reports] == [0, 1, 2, 3]
    assert [(r["node_rank"], r["local_rank"]) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["world_size"] for r in reports} == {4}
    assert {r["all_reduce_sum"] for r in reports} == {10.0}
    shards = [r["samples"] for r in reports]
    assert all(len(shard) == 16 for shard in shards)
    assert sorted(x for shard in shards for x in shard) == list(range(64)), "disjoint quarters covering the data"


def test_help_lists_every_option() -> None:
    code, out, _ = _run([*FABRIC, "run", "--help"], timeout=30)
    assert code == 0
    for option in ("--accelerator", "--strategy", "--devices", "--num-nodes", "--node-rank", "--main-address",
                   "--main-port", "--precision", "SCRIPT_ARGS"):  # fmt: skip
        assert option in out


def test_code_contradicting_cli_fails_with_both_values(tmp_path: Path) -> None:
    port = str(_free_port())
    argv = ["run", "--accelerator", "cpu", "--precision", "32-true", "--main-port", port, "cli_contradiction.py"]
    code, _, err = _run([*FABRIC, *argv])
    assert code != 0
    assert (
        "Fabric(precision='bf16-mixed') contradicts 'fabric run --precision 32-true'. Set it in one place: "
        "remove it from the code or from the command." in err
    )
    assert "fabric run: a process failed." in err


def test_port_in_use_fails_fast(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        argv = ["run", "--accelerator", "cpu", "--devices", "2", "--main-port", str(port), "cli_report.py", "x"]
        code, _, err = _run([*FABRIC, *argv], timeout=30)
    assert code == 2
    assert f"fabric run --main-port {port}: port {port} on 127.0.0.1 is already in use. Choose a free port" in err


def test_missing_script_and_bad_option(tmp_path: Path) -> None:
    code, _, err = _run([*FABRIC, "run", "--accelerator", "cpu", "no_such.py"], timeout=30)
    assert code == 2
    assert "fabric run: script 'no_such.py' does not exist." in err
    code, _, err = _run([*FABRIC, "run", "--precision", "8-true", "cli_report.py"], timeout=30)
    assert code == 2
    assert "argument --precision: invalid choice: '8-true'" in err


# -- stopping `fabric run` -------------------------------------------------------------------------------
def _children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _wait_at_rendezvous(proc: subprocess.Popen, node_rank: int, port: int) -> None:
    """Until `fabric run` waits at the rendezvous: node 0 serves the store on PORT, node 1 runs torchrun's loop."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if node_rank == 0:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    return
        # torchrun names its main thread when it starts; the rendezvous follows at once.
        elif Path(f"/proc/{proc.pid}/comm").read_text().strip() == "pt_elastic":
            time.sleep(1.0)  # inside the store's connect loop
            return
        time.sleep(0.1)
    _finish(proc, time.monotonic())


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="the test finds the processes in /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("node_rank", [0, 1])
def test_a_signal_stops_fabric_run_waiting_at_the_rendezvous(tmp_path: Path, signum: int, node_rank: int) -> None:
    # Node 1 of 2 with nobody serving the address, or node 0 waiting for a node 1 that never comes up: torch's
    # store loops in C++, where Python's signal handlers never ran (only SIGKILL ended it).
    port = _free_port()
    argv = ["run", "--accelerator", "cpu", "--devices", "2", "--num-nodes", "2", "--node-rank", str(node_rank),
            "--main-address", "127.0.0.1", "--main-port", str(port), "cli_report.py", str(tmp_path)]  # fmt: skip
    proc = _start([sys.executable, "-m", "fabric", *argv])
    _wait_at_rendezvous(proc, node_rank, port)
    assert _children_of(proc.pid) == [], "no worker starts before the rendezvous completes"
    proc.send_signal(signum)
    code, _, err = _finish(proc, time.monotonic() + 60)  # a failure bound, not a timing assertion
    assert code == 128 + signum, err
    name = signal.Signals(signum).name
    assert f"fabric run: stopped by {name} while none of its processes was running" in err, err
    assert not list(tmp_path.glob("rank*.json")), "no script ran"


def test_sigterm_ends_a_script_that_does_not_read_preempted_with_128_plus_15(tmp_path: Path) -> None:
    port = str(_free_port())
    script = [str(runner.SCRIPTS / "ends_job.py"), str(tmp_path), "external", "train"]  # never reads preempted
    proc = _start([sys.executable, "-m", "fabric", "run", "--accelerator", "cpu", "--devices", "2",
                   "--main-port", port, *script])  # fmt: skip
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"rank{rank}.pid.json").exists() for rank in (0, 1)):
        if proc.poll() is not None or time.monotonic() > deadline:
            _finish(proc, time.monotonic())
            pytest.fail("the ranks did not start")
        time.sleep(0.1)
    pids = [json.loads((tmp_path / f"rank{rank}.pid.json").read_text())["pid"] for rank in (0, 1)]
    proc.send_signal(signal.SIGTERM)
    code, _, err = _finish(proc, time.monotonic() + 60)
    assert code == 128 + signal.SIGTERM, err
    assert "fabric run: stopped by SIGTERM. It was passed on to the workers, and it ended global rank(s) " in err
    assert "failed first" not in err, err
    assert runner.wait_gone(pids, 5.0) == [], "a rank outlived fabric run"
    assert not list(tmp_path.glob("*.unexpected.json"))
