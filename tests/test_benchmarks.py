"""The benchmark scripts still run and print their tables (their quick --smoke modes; no timing is asserted)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from collections import Counter
from itertools import pairwise
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
# A table row with a ratio to its baseline, e.g. "fabric   412.0   3.1   400.2   1   1.020x (+2.0%) ..."
RATIO_ROW = r"^{label}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+\s+[\d.]+x \([+-][\d.]+%\)"
_JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES and k != "FABRIC_BENCH_PEER_PYTHON"}
    return subprocess.run(
        [sys.executable, *args], cwd=BENCHMARKS, env=clean | (env or {}), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _smoke(script: str, *args: str) -> str:
    """`script --smoke [args]`'s output, once it exited cleanly and printed the machine line first."""
    result = _run(script, *args, "--smoke")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("machine: "), result.stdout
    return result.stdout


def _assert_ratio_row(output: str, label: str) -> None:
    assert re.search(RATIO_ROW.format(label=re.escape(label)), output, re.MULTILINE), output


@pytest.mark.multiprocess
def test_launch_startup_smoke_times_both_launchers() -> None:
    out = _smoke("launch_startup.py")
    assert "start -> every rank finished step 1" in out and "start -> the command exited" in out
    assert re.search(r"^raw fork\s+[\d.]+", out, re.MULTILINE), out
    _assert_ratio_row(out, "fabric ddp_fork")


def _assert_paired_rows(out: str, raw: str, rounds: int = 2, with_peers: bool = True) -> None:
    """raw, fabric and (where importable and `with_peers`) Lightning Fabric from one run, each with its per-round
    ratio band."""
    assert re.search(r"^load avg [\d.]+ at start$", out, re.MULTILINE), out
    assert re.search(rf"^{raw}\s+[\d.]+", out, re.MULTILINE), out
    lightning = with_peers and importlib.util.find_spec("lightning_fabric") is not None
    peers = ["fabric"] + (["lightning_fabric"] if lightning else [])
    for label in peers:
        _assert_ratio_row(out, label)
        band = rf"^ratio {label} / raw: [\d.]+x \(p25-p75 [\d.]+-[\d.]+x, n={rounds}\)"
        assert re.search(band, out, re.MULTILINE), out
        assert re.search(rf"^difference {label} - raw: [+-][\d.]+ us/step", out, re.MULTILINE), out


@pytest.mark.multiprocess
def test_step_overhead_smoke_pairs_raw_fabric_and_lightning_in_one_process() -> None:
    out = _smoke("step_overhead.py")
    assert "tiny MLP 32->64->64->10, batch 32, data from tensors; 1 process x 2 rounds x 5 alternated steps" in out
    _assert_paired_rows(out, "raw torch")


@pytest.fixture(scope="module")
def ddp_step_two_jobs() -> str:
    """One `ddp_step.py --smoke --jobs 2` run (the ranks pinned where there are 2 cores), read by several tests: each
    job is a 2-rank job of seconds of imports. The one-job and --no-pin descriptions are checked in-process."""
    result = _run("ddp_step.py", "--smoke", "--jobs", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.multiprocess
def test_ddp_step_smoke_pairs_raw_ddp_with_fabric_in_one_process_group(ddp_step_two_jobs: str) -> None:
    out = ddp_step_two_jobs
    assert "DDP, 2 CPU processes (gloo), tiny MLP 32->64->64->10, batch 32/rank; 2 jobs" in out, out
    _assert_paired_rows(out, "raw DDP", rounds=4)  # 2 rounds of each of the 2 jobs
    # The control (a second raw DDP) shows the noise floor; each rank runs on a core of its own (2 cores here).
    _assert_ratio_row(out, "raw, 2nd copy (control)")
    assert re.search(r"^ratio raw2 / raw: [\d.]+x \(p25-p75 [\d.]+-[\d.]+x, n=4\)", out, re.MULTILINE), out
    # Rank 0's main-thread CPU time per step, beside the wall clock: raw DDP's, then each contender's against it.
    assert re.search(r"^CPU time of rank 0's main thread per step, raw DDP: [\d.]+ us$", out, re.MULTILINE), out
    assert re.search(r"^ratio fabric / raw, CPU: [\d.]+x \(p25-p75 [\d.]+-[\d.]+x, n=4\)", out, re.MULTILINE), out
    assert re.search(r"^CPU difference fabric - raw: [+-][\d.]+ us/step", out, re.MULTILINE), out
    pinned = len(os.sched_getaffinity(0)) >= 2 if hasattr(os, "sched_getaffinity") else False
    assert ("1 thread/rank, each rank pinned to a core" if pinned else "ranks not pinned to cores") in out


@pytest.mark.multiprocess
def test_ddp_step_pools_the_rounds_of_several_jobs(ddp_step_two_jobs: str) -> None:
    out = ddp_step_two_jobs
    # Each job's own medians first (its control shows that job's bias), then one table over the pooled rounds.
    # Job j builds the models in the contenders' order rotated by j: each contender's model is built first once.
    for job, first in ((1, "raw"), (2, "raw2")):
        line = rf"^job {job} of 2 \(built first: {first}\): median ratio to raw DDP: raw2 [\d.]+x, fabric [\d.]+x"
        assert re.search(line, out, re.MULTILINE), out
    title = "tiny MLP 32->64->64->10, batch 32/rank; 2 jobs (each building the models in another order) x 2 rounds x 5"
    assert title in out


def _one_model_run(flag: str) -> str:
    """`ddp_step.py --smoke <flag>` (--same-model or --components: raw DDP and its control step the DDP module,
    optimizer and batches fabric set up, with fabric's forward guard set aside outside their time), checked for what
    every such run prints. No raw step may reach the guard's warning: it would mean the raw steps ran with a hook on
    the module, slower than raw DDP runs without fabric."""
    result = _run("ddp_step.py", "--smoke", flag)
    assert result.returncode in (0, 1), result.stdout + result.stderr  # 1: a target missed on a loaded machine
    out = result.stdout
    assert "1 job (one model per job: raw DDP steps the DDP module, optimizer and batches fabric set up)" in out, out
    _assert_paired_rows(out, "raw DDP", rounds=2, with_peers=False)
    _assert_ratio_row(out, "raw, 2nd copy (control)")
    assert "fabric.setup()" not in result.stderr, result.stderr  # the guard's warning names fabric.setup()
    return out


@pytest.mark.multiprocess
def test_ddp_step_same_model_steps_fabrics_own_ddp_module_raw_and_through_fabric() -> None:
    out = _one_model_run("--same-model")
    for peer in ("lightning_fabric", "accelerate"):
        assert not re.search(rf"^{peer} ", out, re.MULTILINE), out  # a peer cannot step fabric's model
    if importlib.util.find_spec("lightning_fabric") is not None:
        assert "skipped: lightning_fabric: --same-model steps one model that fabric set up" in out, out


@pytest.mark.multiprocess
def test_ddp_step_components_time_each_of_fabrics_calls_in_an_otherwise_raw_step() -> None:
    # fabric's model call (and the same without the guard), fabric.backward and fabric's step, each alone in a raw
    # DDP step on the model fabric set up, beside raw DDP and fabric's whole step.
    out = _one_model_run("--components")
    for name, label in (("forward", "fabric's model call only"), ("unguarded", "the same without the guard"),
                        ("backward", "fabric.backward only"), ("step", "fabric's step only")):  # fmt: skip
        _assert_ratio_row(out, label)
        assert re.search(rf"^CPU difference {name} - raw: [+-][\d.]+ us/step", out, re.MULTILINE), out


@pytest.mark.multiprocess
def test_ddp_layer_times_fabrics_calls_on_one_process_with_the_guard_installed() -> None:
    # One process, DDP over a gloo group of one, fabric's forward guard installed as for several processes (the
    # script refuses to report without it): raw DDP, its control, fabric and each of fabric's calls alone.
    out = _smoke("ddp_layer.py")
    assert "2 rounds x 20 steps per contender" in out, out
    assert re.search(r"^raw DDP\s+[\d.]+", out, re.MULTILINE), out
    labels = ("raw, 2nd copy (control)", "fabric", "fabric's model call only", "the same without the guard",
              "fabric.backward only", "fabric's step only")  # fmt: skip
    for label in labels:
        _assert_ratio_row(out, label)
    for name in ("raw2", "fabric", "forward", "unguarded", "backward", "step"):
        difference = rf"^CPU difference {name} - raw: [+-][\d.]+ us/step \(p25-p75 [+-][\d.]+ to [+-][\d.]+, "
        assert re.search(difference, out, re.MULTILINE), out


def test_ddp_step_describes_one_job_and_unpinned_ranks_and_passes_no_pin_to_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What the default one job and --no-pin change besides what the shared run above shows: the title, and the option
    # each rank gets (a rank given --no-pin does not pin its threads: `pin and _pin_threads(...)` in its worker).
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # _common and step_overhead, as the script imports them
    ddp_step = _load("ddp_step")

    def rank_args(*options: str) -> argparse.Namespace:
        argv = ddp_step._worker_argv(ddp_step.parse(options, ddp_step._options), "tiny", 2, ["raw", "fabric"])
        return ddp_step.parse(argv[1:], ddp_step._options)

    unpinned, pinned = rank_args("--smoke", "--no-pin"), rank_args("--smoke")
    assert unpinned.worker == ["tiny", "-", "2", "raw,fabric"] and unpinned.smoke and unpinned.no_pin
    assert pinned.smoke and not pinned.no_pin
    title = ddp_step._title("tiny", True, 1, 2, False)
    assert "DDP, 2 CPU processes (gloo), tiny MLP 32->64->64->10, batch 32/rank; 1 job x 2 rounds x 5 alternated" in (
        title
    )
    assert "1 thread/rank, ranks not pinned to cores" in title


def test_log_overhead_smoke_times_log_dict_and_rank_zero_only_beside_a_raw_csv_writer() -> None:
    out = _smoke("log_overhead.py")
    assert "log_dict of a tensor and a float, CSV written every 100 calls" in out
    _assert_ratio_row(out, "fabric")
    assert re.search(r"^ratio fabric / raw call: [\d.]+x", out, re.MULTILINE), out
    assert re.search(r"^fabric: [+-][\d.]+ us per call", out, re.MULTILINE), out


@pytest.mark.multiprocess
def test_uneven_all_gather_smoke_compares_uneven_with_equal() -> None:
    out = _smoke("uneven_all_gather.py")
    assert "all_gather, 2 CPU processes (gloo)" in out
    _assert_ratio_row(out, "fabric uneven")
    _assert_ratio_row(out, "strategy equal")
    assert re.search(r"^target: fabric uneven vs fabric equal < 1.20x -> median [\d.]+x", out, re.MULTILINE), out


@pytest.mark.multiprocess
def test_checkpoint_smoke_measures_save_and_load_and_run_all_draws_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _smoke("checkpoint.py")
    for title in ("save: time", "save: peak RSS increase", "load: time", "load: peak RSS increase"):
        assert f"Checkpoint {title}" in out, out
    _assert_ratio_row(out, "fabric")
    assert re.search(r"target: fabric\.save vs torch\.save < 1\.05x -> median [\d.]+x", out), out
    assert re.search(r"target: fabric\.load vs torch\.load < 1\.05x -> median [\d.]+x", out), out
    # The same smoke output, drawn by run_all as it draws a full run's (from a --tee file here). Its command line runs
    # in this process: it starts nothing, and a process of its own would import matplotlib again (seconds).
    tee = tmp_path / "results.txt"
    tee.write_text("=== python benchmarks/checkpoint.py --smoke\n" + out)
    chart = tmp_path / "img" / "bench.png"
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # and puts back the sys.path that run_all extends to load _chart
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--chart-from", str(tee), "--chart", str(chart)])
    capsys.readouterr()
    assert _load("run_all").main() == 0
    assert "run_all: chart of 4 tables written to" in capsys.readouterr().out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiprocess
def test_checkpoint_async_smoke_measures_blocking_and_sync_saves() -> None:
    out = _smoke("checkpoint_async.py")
    assert "Synchronous save: time" in out and "Time fabric.save blocks the loop" in out, out
    for label in ("fabric sync", "fabric async, first save", "fabric async, later saves"):
        _assert_ratio_row(out, label)
    assert re.search(r"^load avg [\d.]+ at start", out, re.MULTILINE), out
    for ratio in (
        r"async first save blocking / sync fabric\.save: [\d.]+x \(p25-p75 [\d.]+-[\d.]+x, n=1\).* <= 0\.25x",
        r"async later saves blocking / sync fabric\.save: [\d.]+x .* <= 0\.10x",
        r"sync fabric\.save / torch\.save \+ fsync: [\d.]+x .* <= 1\.10x",
    ):
        assert re.search(f"^ratio {ratio}", out, re.MULTILINE), out


@pytest.mark.multiprocess
def test_fork_after_async_smoke_times_fork_before_and_after_a_save() -> None:
    out = _smoke("fork_after_async.py")
    assert re.search(r"^load avg [\d.]+ at start", out, re.MULTILINE), out
    _assert_ratio_row(out, "fabric, after an async save")
    assert re.search(r"^ratio fork\(\) after an async save / before: [\d.]+x .* <= 1\.20x", out, re.MULTILINE), out


@pytest.mark.multiprocess
def test_collectives_smoke_prints_raw_and_fabric_per_case_with_the_ratio_band() -> None:
    out = _smoke("collectives.py")
    assert re.search(r"^load avg [\d.]+ at start$", out, re.MULTILINE), out
    for case in ("all_gather 4 KB", "all_gather 1 MB", "all_reduce 4 KB", "all_reduce 1 MB", "barrier"):
        assert f"{case}, 2 CPU ranks (gloo), 1 thread" in out, out
        band = rf"^ratio {case} fabric / raw: [\d.]+x \(p25-p75 [\d.]+-[\d.]+x, n=1\).* target <= 1.05x: (PASS|FAIL)$"
        assert re.search(band, out, re.MULTILINE), out
    _assert_ratio_row(out, "fabric")


@pytest.mark.multiprocess
def test_collective_record_overhead_smoke_reports_the_cost_per_collective() -> None:
    out = _smoke("collective_record_overhead.py")
    for label in ("fabric, recording on", "fabric, FABRIC_DEBUG_COLLECTIVES=1", "recording context alone"):
        _assert_ratio_row(out, label)
    assert re.search(r"^recording overhead per collective: [\d.]+ us on the calling thread", out, re.MULTILINE), out
    assert re.search(r"^target: calling-thread cost of recording < 50 us -> [\d.]+ us: (PASS|FAIL)$", out, re.M), out


def test_cuda_precision_code_paths_run_on_cpu() -> None:
    out = _smoke("cuda_precision.py", "--device", "cpu")
    assert "bf16-mixed on cpu" in out
    _assert_ratio_row(out, "fabric")


def test_cuda_precision_without_gpu_says_so() -> None:
    # An empty CUDA_VISIBLE_DEVICES hides every GPU, so this holds on a GPU machine too.
    result = _run("cuda_precision.py", env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert result.returncode == 1
    assert "cuda_precision.py: no CUDA GPU is visible" in result.stderr
    assert "pass --device cpu --smoke to check the code paths on the CPU" in result.stderr


def test_run_all_runs_every_benchmark_script() -> None:
    spec = importlib.util.spec_from_file_location("run_all", BENCHMARKS / "run_all.py")
    assert spec is not None and spec.loader is not None
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    parser_defaults = {"rounds": 2, "peer_python": "/peer/python", "cuda": True, "smoke": False}
    planned = run_all.plan(type("Args", (), parser_defaults)())
    scripts = {p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_") and p.name != "run_all.py"}
    assert {s[0] for s in planned} == scripts
    # Every script that has a peer to compare with gets it (pipeline_bubble.py compares with theory instead, and
    # ddp_layer.py times fabric's calls on fabric's own model, which no peer can step).
    alone = ("pipeline_bubble.py", "ddp_layer.py")
    assert all(s[-2:] == ["--peer-python", "/peer/python"] for s in planned if s[0] not in alone)


def _load(name: str) -> ModuleType:
    """A module of benchmarks/ (not a package), registered so that its dataclasses resolve their module."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_chart_reads_back_printed_tables_with_peers_and_the_noise_band(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # _common, as the scripts import it
    common, chart = _load("_common"), _load("_chart")
    rows = [
        common.Row("raw torch", [100.0, 110.0, 120.0, 130.0, 140.0]),
        common.Row("fabric", [101.0, 111.0, 121.0, 131.0, 141.0], [100.0, 110.0, 120.0, 130.0, 140.0]),
        common.Row("raw torch (peer)", [132.0] * 5),
        common.Row("lightning_fabric (peer)", [198.0] * 5, [132.0] * 5),
    ]
    print("=== python benchmarks/step_overhead.py --rounds 5\nmachine: CPU, 2 cores, Linux, load avg 1.50 | x")
    print("skipped: accelerate: not importable by /p/python")
    common.print_table("tiny MLP, 1 thread", rows, "us/step")
    (table,) = chart.parse_tables(capsys.readouterr().out)
    assert (table.script, table.title, table.unit) == ("step_overhead.py", "tiny MLP, 1 thread", "us/step")
    assert [row.label for row in table.rows] == [row.label for row in rows]
    assert table.skipped == ["accelerate: not importable by /p/python"]
    assert table.load == "1.50"
    points, band = chart.chart_points(table)
    assert [p.label for p in points] == ["fabric", "lightning_fabric (peer)", "raw torch (peer) vs raw torch"]
    assert [round(p.ratio, 3) for p in points] == [1.008, 1.5, 1.1]
    # raw torch: quartiles 110 and 130 (interpolated within the samples), so IQR 20, half of it over the median 120.
    assert band == pytest.approx((1 - 10 / 120, 1 + 10 / 120))


def test_chart_draws_one_panel_per_table_and_refuses_an_empty_output(tmp_path: Path) -> None:
    chart = _load("_chart")
    table = chart.Table("ddp_step.py", "DDP, tiny MLP", "us/step", [
        chart.Row("raw DDP", 100.0, 10.0, 95.0, 9), chart.Row("fabric", 101.0, 12.0, 96.0, 9, 1.01, 1.011),
    ])  # fmt: skip
    path = chart.draw([table], tmp_path / "one.png", "2 cores")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no table with a ratio to raw PyTorch"):
        chart.draw(chart.parse_tables("machine: nothing ran"), tmp_path / "none.png")


def test_percentiles_of_few_samples_stay_within_the_samples() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        from _common import median_iqr, p10
    finally:
        sys.path.pop(0)
    assert 100.0 <= p10([100.0, 200.0]) <= 200.0  # the default quantile method gave a negative time here
    assert median_iqr([100.0, 200.0]) == (150.0, 50.0)


@pytest.mark.multiprocess
def test_loader_state_smoke_times_the_capture_and_both_saves() -> None:
    result = _run("loader_state.py", "--smoke")
    assert result.returncode in (0, 1), result.stdout + result.stderr  # 1: a target missed on a loaded machine
    out = result.stdout
    for case in ("1 process, num_workers=0", "1 process, num_workers=2"):
        assert f"Loader state, {case}: 20 reps" in out, out
        target = rf"target: loader state adds < 1 ms to fabric.save \({case}\) -> capture \+ serialize median [\d.]+ ms"
        assert re.search(target, out), out
    _assert_ratio_row(out, "fabric.save with loader")


def test_step_orders_put_each_contender_after_each_other_equally_often() -> None:
    common = _load("_common")
    names = ["raw", "raw2", "fabric", "lightning_fabric"]
    orders = common.step_orders(names, 4000, seed=3)
    assert orders == common.step_orders(names, 4000, seed=3), "seeded: every rank of a job runs the same orders"
    assert all(sorted(order) == sorted(names) for order in orders)
    sequence = [name for order in orders for name in order]
    after = Counter(pairwise(sequence))
    places = Counter((place, name) for order in orders for place, name in enumerate(order))
    assert all(900 < places[place, name] < 1100 for place in range(4) for name in names)  # 1000 expected
    # Another contender before: 1000 inside orders plus 250 across their boundaries expected; itself: 250.
    assert all(1100 < after[first, then] < 1400 for first in names for then in names if first != then)
    assert all(180 < after[name, name] < 330 for name in names)


def test_build_orders_build_each_contender_first_in_one_job() -> None:
    orders = _load("_common").build_orders(["raw", "raw2", "fabric"], 3)
    assert orders == [["raw", "raw2", "fabric"], ["raw2", "fabric", "raw"], ["fabric", "raw", "raw2"]]


def test_pooled_jobs_runs_each_build_order_once_and_keeps_every_sample() -> None:
    calls: list[tuple[int, list[str]]] = []

    def run_job(job: int, order: list[str]) -> dict[str, list[float]]:
        calls.append((job, order))
        return {name: [10.0 * job + place] for place, name in enumerate(order)}

    pooled = _load("_common").pooled_jobs(["raw", "fabric"], 2, run_job)
    assert calls == [(0, ["raw", "fabric"]), (1, ["fabric", "raw"])]
    assert pooled == {"raw": [0.0, 11.0], "fabric": [1.0, 10.0]}  # job 0's sample, then job 1's


def test_per_round_ratio_lines_become_a_panel_that_marks_the_noise(capsys: pytest.CaptureFixture[str]) -> None:
    common, chart = _load("_common"), _load("_chart")
    # Paired rounds: fabric is 1-3% slower in each round, Lightning twice as slow; a band across 1.0 is noise.
    raw = [100.0, 120.0, 90.0, 110.0, 105.0, 95.0, 130.0, 100.0, 115.0]
    ours = [r * f for r, f in zip(raw, [1.01, 0.99, 1.02, 0.98, 1.03, 1.0, 0.97, 1.01, 1.02], strict=True)]
    assert common.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert common.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]  # reversed
    assert common.round_order(["a", "b", "c"], 2) == ["b", "c", "a"]  # rotated by one
    assert [common.round_order(["a", "b"], r)[0] for r in range(4)] == ["a", "b", "b", "a"]  # two alternate
    print("=== python benchmarks/collectives.py\nmachine: CPU, 2 cores, Linux, load avg 0.20 | x")
    assert common.print_ratio("fabric all_reduce 4 KB", ours, raw, target=1.05)
    assert not common.print_ratio("lightning_fabric all_reduce 4 KB", [r * 2 for r in raw], raw, target=1.05)
    out = capsys.readouterr().out
    assert "(inside the noise) target <= 1.05x: PASS" in out and "2.000x (p25-p75 2.000-2.000x, n=9)" in out
    (table,) = chart.parse_tables(out)
    points, band = chart.chart_points(table)
    assert band is None and [p.label for p in points] == ["fabric all_reduce 4 KB", "lightning_fabric all_reduce 4 KB"]
    assert points[0].low <= 1.0 <= points[0].high and points[1].ratio == pytest.approx(2.0)


@pytest.mark.multiprocess
def test_loader_overhead_smoke_compares_raw_fabric_and_lightning_per_batch_and_per_epoch_start() -> None:
    out = _smoke("loader_overhead.py")
    assert re.search(r"^load avg [\d.]+ at start$", out, re.MULTILINE), out
    assert "Per batch, num_workers=0" in out and "Epoch start (iter to first batch), num_workers=2" in out, out
    for label in ("fabric", "fabric freeze_gc"):
        _assert_ratio_row(out, label)
    assert re.search(r"^ratio fabric / raw per batch: [\d.]+x \(p25-p75 [\d.]+-[\d.]+x, n=2\)", out, re.M), out
    assert "Epoch start, workers that collect garbage first (worker_init_fn=gc.collect)" in out, out
    assert re.search(r"^target: fabric epoch start <= raw \+ 0.5 ms -> [+-][\d.]+ ms: (PASS|FAIL)", out, re.M), out
