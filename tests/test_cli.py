"""Unit tests for `fabric run` (no processes): parsing, the torchrun command, and how CLI flags meet code flags."""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fabric.accelerators.cuda as cuda_module
from fabric import CPUAccelerator, DDPStrategy, Fabric, HalfPrecision, MixedPrecision, SingleDeviceStrategy, cli
from fabric._cli_flags import cli_flags as _cli_flags

OPTIONS = ("--accelerator", "--strategy", "--devices", "--num-nodes", "--node-rank", "--main-address", "--main-port",
           "--precision")  # fmt: skip


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Replace torchrun by a recorder: main() runs everything up to starting the processes."""
    calls: list[list[str]] = []

    def fake_torchrun(argv: list[str]) -> int:
        calls.append(argv)
        return 0

    monkeypatch.setattr(cli, "_torchrun", fake_torchrun)
    for name in ("ACCELERATOR", "STRATEGY", "DEVICES", "NUM_NODES", "PRECISION", "CLI_USED"):
        monkeypatch.delenv(f"FABRIC_CLI_{name}", raising=False)
        monkeypatch.delenv(f"LT_{name}", raising=False)
    return calls


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _parse(*argv: str) -> argparse.Namespace:
    return cli.parse_args(cli.build_parser(), ["run", *argv])


# -- parsing -------------------------------------------------------------------------------------
def test_defaults() -> None:
    args = _parse("train.py")
    assert (args.accelerator, args.strategy, args.devices, args.precision) == ("auto", "auto", "1", None)
    assert (args.num_nodes, args.node_rank, args.main_address, args.main_port) == (1, 0, "127.0.0.1", 29400)


def test_options_after_the_script_are_fabric_run_s_as_in_lightning() -> None:
    args = _parse("train.py", "--devices", "2", "--precision", "bf16-mixed", "--num_nodes=1", "--accelerator=cpu")
    assert (args.script, args.devices, args.precision, args.num_nodes, args.accelerator) == (
        "train.py", "2", "bf16-mixed", 1, "cpu")  # fmt: skip
    assert args.script_args == []


def test_unknown_options_and_words_go_to_the_script_in_order() -> None:
    args = _parse("--devices", "2", "train.py", "--lr", "0.1", "data", "--strategy", "ddp", "-h", "--dev", "3")
    assert (args.devices, args.strategy, args.script) == ("2", "ddp", "train.py")
    # -h after SCRIPT and abbreviations are the script's, as with click (which knows only --help, in full).
    assert args.script_args == ["--lr", "0.1", "data", "-h", "--dev", "3"]


def test_everything_after_double_dash_goes_to_the_script_verbatim() -> None:
    args = _parse("train.py", "--devices", "2", "--", "--devices", "3", "--", "-h", "--precision=64")
    assert args.devices == "2"
    assert args.script_args == ["--devices", "3", "--", "-h", "--precision=64"]
    args = _parse("--devices=2", "--", "train.py", "--precision", "16-mixed")
    assert (args.script, args.devices, args.precision) == ("train.py", "2", None)
    assert args.script_args == ["--precision", "16-mixed"]


def test_a_fabric_option_value_may_start_with_a_dash() -> None:
    assert _parse("train.py", "--devices", "-1").devices == "-1"


def test_bad_option_after_the_script_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("train.py", "--precision", "8-true")
    assert "argument --precision: invalid choice: '8-true'" in capsys.readouterr().err


def test_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in OPTIONS:
        assert option in text
    assert text.count("Default:") >= len(OPTIONS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus", "train.py"], "unrecognized arguments: --bogus"),
        (["--precision", "8-true", "train.py"], "argument --precision: invalid choice: '8-true'"),
        (["--accelerator", "tpu9", "train.py"], "argument --accelerator: invalid choice: 'tpu9'"),
        (["--strategy", "ddp_spwan", "train.py"], "argument --strategy: invalid choice: 'ddp_spwan'"),
        (["--num-nodes", "0", "train.py"], "argument --num-nodes: '0' must be 1 or more"),
        (["--num-nodes", "two", "train.py"], "argument --num-nodes: 'two' is not an int"),
        (["--node-rank", "-1", "train.py"], "argument --node-rank: '-1' must be 0 or more"),
        (["--main-port", "70000", "train.py"], "argument --main-port: '70000' is not a TCP port"),
        ([], "the following arguments are required: SCRIPT"),
    ],
)
def test_bad_options_exit_with_status_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_script(launched: list, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--accelerator", "cpu", "no_such_script.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fabric run: script 'no_such_script.py' does not exist. Check the path")
    assert launched == []


def test_node_rank_outside_the_nodes(script: Path, launched: list, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--num-nodes", "2", "--node-rank", "2", str(script)]) == 2
    assert "fabric run --num-nodes 2 --node-rank 2: node rank 2 does not exist among 2 machine(s). Pass --node-rank " \
        "from 0 to 1." in capsys.readouterr().err  # fmt: skip
    assert launched == []


def test_port_in_use_fails_before_launching(script: Path, launched: list, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code = cli.main(["run", "--accelerator", "cpu", "--main-port", str(port), str(script)])
    assert code == 2
    assert f"fabric run --main-port {port}: port {port} on 127.0.0.1 is already in use. Choose a free port" in (
        capsys.readouterr().err
    )
    assert launched == []


def test_port_is_only_checked_on_node_rank_0(script: Path, launched: list) -> None:
    with socket.socket() as busy:  # on other nodes the port lives on the main machine, not here
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        argv = ["run", "--accelerator", "cpu", "--num-nodes", "2", "--node-rank", "1", "--main-port", port]
        assert cli.main([*argv, str(script)]) == 0
    assert len(launched) == 1


# -- what is launched ----------------------------------------------------------------------------
def test_main_builds_torchrun_args_and_cli_environment(script: Path, launched: list[list[str]]) -> None:
    port = _free_port()
    argv = ["run", "--accelerator", "cpu", "--devices", "3", "--num-nodes", "2", "--node-rank", "0"]
    argv += ["--main-address", "127.0.0.1", "--main-port", str(port), "--precision", "bf16-mixed", "--strategy", "ddp"]
    assert cli.main([*argv, str(script), "--lr", "0.1", "--", "--devices", "7"]) == 0
    assert launched == [
        ["--nproc_per_node=3", "--nnodes=2", "--node_rank=0", "--master_addr=127.0.0.1", f"--master_port={port}",
         "--module", "fabric.strategies.launchers._run_worker", str(script), "--lr", "0.1", "--devices", "7"]
    ]  # fmt: skip
    assert {k: v for k, v in os.environ.items() if k.startswith("FABRIC_CLI_")} == {
        "FABRIC_CLI_ACCELERATOR": "cpu",
        "FABRIC_CLI_STRATEGY": "ddp",
        "FABRIC_CLI_DEVICES": "3",
        "FABRIC_CLI_NUM_NODES": "2",
        "FABRIC_CLI_PRECISION": "bf16-mixed",
    }
    assert {k: v for k, v in os.environ.items() if k.startswith("LT_")} == {
        "LT_CLI_USED": "1",
        "LT_ACCELERATOR": "cpu",
        "LT_STRATEGY": "ddp",
        "LT_DEVICES": "3",
        "LT_NUM_NODES": "2",
        "LT_PRECISION": "bf16-mixed",
    }


def test_precision_left_unset_is_not_passed(script: Path, launched: list) -> None:
    assert cli.main(["run", "--accelerator", "cpu", "--main-port", str(_free_port()), str(script)]) == 0
    assert "FABRIC_CLI_PRECISION" not in os.environ
    assert os.environ["FABRIC_CLI_DEVICES"] == "1", "the default is one process"
    # Like Lightning's CLI: no LT_PRECISION, and no LT_STRATEGY for a strategy left at auto.
    assert "LT_PRECISION" not in os.environ and "LT_STRATEGY" not in os.environ
    assert (os.environ["LT_CLI_USED"], os.environ["LT_DEVICES"], os.environ["LT_NUM_NODES"]) == ("1", "1", "1")


def test_lightning_underscore_spellings_and_upper_case_names_are_accepted() -> None:
    args = _parse("--num_nodes", "2", "--node_rank", "1", "--main_address", "10.0.0.1", "--main_port", "1234",
                  "--accelerator", "CPU", "--strategy", "DDP", "--precision", "BF16-Mixed", "train.py")  # fmt: skip
    assert (args.num_nodes, args.node_rank, args.main_address, args.main_port) == (2, 1, "10.0.0.1", 1234)
    assert (args.accelerator, args.strategy, args.precision) == ("cpu", "ddp", "bf16-mixed")


def test_omp_num_threads_defaults_to_the_cpus_shared_among_the_processes(
    script: Path, launched: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert (
        cli.main(["run", "--accelerator", "cpu", "--devices", "2", "--main-port", str(_free_port()), str(script)]) == 0
    )
    assert os.environ["OMP_NUM_THREADS"] == "4"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert (
        cli.main(["run", "--accelerator", "cpu", "--devices", "2", "--main-port", str(_free_port()), str(script)]) == 0
    )
    assert os.environ["OMP_NUM_THREADS"] == "3", "a value the user set is kept"


def test_installed_fabric_script_runs_our_cli() -> None:
    """lightning installs a `fabric` script too; pip writing it after ours would silently replace our CLI."""
    script = Path(sys.executable).with_name("fabric")
    if not script.is_file():
        pytest.skip(f"no `fabric` script next to {sys.executable} (the package is not installed in this environment)")
    text = script.read_text(errors="replace")
    assert "fabric.cli" in text and "lightning" not in text, f"{script} runs another package's CLI:\n{text}"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "consolidate" in result.stdout and "Command-line tools for fabric." in result.stdout


@pytest.mark.parametrize(("devices", "count"), [("1", 1), ("4", 4), ("auto", 1), ("-1", os.cpu_count() or 1)])
def test_cpu_process_count(devices: str, count: int) -> None:
    assert cli.process_layout("cpu", devices) == (count, None)


@pytest.mark.parametrize("devices", ["0", "0,1", "x"])
def test_bad_cpu_devices(devices: str) -> None:
    with pytest.raises(cli._CLIError) as exc:
        cli.process_layout("cpu", devices)
    assert exc.value.flags == f" --accelerator cpu --devices {devices}"
    assert str(exc.value)  # the accelerator's own reason and fix


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_module, "_cuda_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ("auto", (4, None)),
        ("-1", (4, None)),
        ("2", (2, None)),
        ("0,1", (2, None)),
        ("1,3", (2, "1,3")),
        ("2,", (1, "2")),
    ],
)
def test_cuda_process_count_and_visible_devices(four_gpus: None, devices: str, expected: tuple) -> None:
    assert cli.process_layout("cuda", devices) == expected
    assert cli.process_layout("gpu", devices) == expected


def test_cuda_list_maps_through_existing_visible_devices(four_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert cli.process_layout("cuda", "1,3") == (2, "5,7")


def test_too_many_gpus(four_gpus: None) -> None:
    with pytest.raises(cli._CLIError, match=r"only 4 CUDA device\(s\) exist here"):
        cli.process_layout("cuda", "8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_unavailable_accelerator(script: Path, launched: list, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--accelerator", "cuda", str(script)]) == 2
    assert "fabric run --accelerator cuda: no CUDA device is available on this machine. Use --accelerator cpu" in (
        capsys.readouterr().err
    )


# -- code flags meet CLI flags (the connector) ---------------------------------------------------
@pytest.fixture
def under_cli(monkeypatch: pytest.MonkeyPatch) -> Any:
    def set_flags(**flags: str) -> None:
        for name in ("ACCELERATOR", "STRATEGY", "DEVICES", "NUM_NODES", "PRECISION", "CLI_USED"):
            monkeypatch.delenv(f"FABRIC_CLI_{name}", raising=False)
            monkeypatch.delenv(f"LT_{name}", raising=False)
        for name, value in flags.items():
            monkeypatch.setenv(f"FABRIC_CLI_{name.upper()}", value)

    return set_flags


def test_cli_flags_read_only_fabric_cli_variables(under_cli: Any) -> None:
    under_cli()
    assert _cli_flags() == {}
    under_cli(accelerator="cpu", num_nodes="1", precision="16-true")
    assert _cli_flags() == {"accelerator": "cpu", "num_nodes": "1", "precision": "16-true"}


def test_not_under_cli() -> None:
    fabric = Fabric(accelerator="cpu")
    assert fabric._under_cli is False


def test_defaults_in_code_take_cli_values(under_cli: Any) -> None:
    under_cli(accelerator="cpu", strategy="auto", devices="1", num_nodes="1", precision="bf16-true")
    fabric = Fabric()
    assert fabric._under_cli is True
    assert isinstance(fabric.accelerator, CPUAccelerator)
    assert isinstance(fabric.strategy, SingleDeviceStrategy)
    assert isinstance(fabric.strategy.precision, HalfPrecision)


@pytest.mark.parametrize(
    ("flag", "cli_value", "code_value"),
    [
        ("precision", "32-true", "bf16-mixed"),
        ("precision", "bf16-mixed", 16),
        ("accelerator", "cpu", "cuda"),
        ("accelerator", "cpu", "gpu"),
        ("strategy", "ddp", "single_device"),
        ("devices", "2", 3),
        ("devices", "2", "0,1,2"),
        ("num_nodes", "2", 3),
    ],
)
def test_code_contradicting_cli_raises(under_cli: Any, flag: str, cli_value: str, code_value: Any) -> None:
    under_cli(**{flag: cli_value})
    option = "--" + flag.replace("_", "-")
    message = (
        f"Fabric({flag}={code_value!r}) contradicts 'fabric run {option} {cli_value}'. Set it in one place: "
        "remove it from the code or from the command."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        Fabric(**{flag: code_value})


def test_contradicting_instance_is_named_by_its_class(under_cli: Any) -> None:
    under_cli(strategy="single_device")
    with pytest.raises(ValueError, match=re.escape("Fabric(strategy=DDPStrategy()) contradicts 'fabric run --strat")):
        Fabric(strategy=DDPStrategy())


@pytest.mark.parametrize(
    ("flag", "cli_value", "code_value"),
    [
        ("precision", "bf16-mixed", "bf16-mixed"),
        ("precision", "bf16", "bf16-mixed"),
        ("precision", "32-true", 32),
        ("accelerator", "cpu", "cpu"),
        ("accelerator", "auto", "cpu"),
        ("strategy", "auto", "single_device"),
        ("strategy", "single_device", "single_device"),
        ("devices", "1", 1),
        ("devices", "1", "1"),
        ("num_nodes", "1", 1),
    ],
)
def test_code_agreeing_with_cli_is_fine(under_cli: Any, flag: str, cli_value: str, code_value: Any) -> None:
    under_cli(**{flag: cli_value})
    kwargs = {"accelerator": "cpu", flag: code_value}
    fabric = Fabric(**kwargs)
    assert fabric._under_cli is True


def test_accelerator_instance_agreeing_with_cli(under_cli: Any) -> None:
    under_cli(accelerator="cpu")
    assert isinstance(Fabric(accelerator=CPUAccelerator()).accelerator, CPUAccelerator)


def test_cli_precision_applies(under_cli: Any) -> None:
    under_cli(accelerator="cpu", precision="bf16-mixed")
    assert isinstance(Fabric().strategy.precision, MixedPrecision)


def test_garbled_cli_count(under_cli: Any) -> None:
    under_cli(num_nodes="two")
    with pytest.raises(ValueError, match=re.escape("FABRIC_CLI_NUM_NODES='two': `fabric run` sets this to a count")):
        Fabric(accelerator="cpu")


# -- Lightning's LT_* variables (set by our `fabric run` and by Lightning's) --------------------------------
@pytest.fixture
def lightning_cli(monkeypatch: pytest.MonkeyPatch, under_cli: Any) -> Any:
    under_cli()  # clears both sets

    def set_lt(**flags: str) -> None:
        for name, value in flags.items():
            monkeypatch.setenv(f"LT_{name.upper()}", value)

    return set_lt


def test_lightning_cli_variables_alone_configure_fabric(lightning_cli: Any) -> None:
    lightning_cli(cli_used="1", accelerator="cpu", devices="1", num_nodes="1", precision="bf16-true")
    fabric = Fabric()
    assert fabric._under_cli is True
    assert isinstance(fabric.accelerator, CPUAccelerator)
    assert isinstance(fabric.strategy, SingleDeviceStrategy)
    assert isinstance(fabric.strategy.precision, HalfPrecision)


def test_lightning_cli_contradiction_raises(lightning_cli: Any) -> None:
    lightning_cli(cli_used="1", precision="32-true", devices="1", num_nodes="1")
    with pytest.raises(ValueError, match=re.escape("Fabric(precision='bf16-true') contradicts 'fabric run --precisi")):
        Fabric(accelerator="cpu", precision="bf16-true")


def test_lt_variable_without_lt_cli_used_replaces_the_code_value_as_in_lightning(lightning_cli: Any) -> None:
    lightning_cli(precision="bf16-true")
    fabric = Fabric(accelerator="cpu", precision="32-true")
    assert fabric._under_cli is False
    assert isinstance(fabric.strategy.precision, HalfPrecision)


@pytest.mark.parametrize("used", ["0", "", "no"])
def test_lt_cli_used_must_be_a_non_zero_number(lightning_cli: Any, used: str) -> None:
    lightning_cli(cli_used=used)
    assert Fabric(accelerator="cpu")._under_cli is False


def test_lt_variable_wins_over_fabric_cli_alias_with_a_warning(lightning_cli: Any, under_cli: Any) -> None:
    under_cli(precision="bf16-mixed")
    lightning_cli(cli_used="1", precision="bf16-true")
    with pytest.warns(UserWarning, match=re.escape("LT_PRECISION='bf16-true' and FABRIC_CLI_PRECISION='bf16-mixed' "
                                                   "disagree; using 'bf16-true'")):  # fmt: skip
        fabric = Fabric(accelerator="cpu")
    assert isinstance(fabric.strategy.precision, HalfPrecision)


def test_equal_lt_and_fabric_cli_variables_do_not_warn(lightning_cli: Any, under_cli: Any, recwarn: Any) -> None:
    under_cli(precision="bf16-true", devices="1")
    lightning_cli(cli_used="1", precision="bf16-true", devices="1")
    assert isinstance(Fabric(accelerator="cpu").strategy.precision, HalfPrecision)
    assert not [w for w in recwarn if "disagree" in str(w.message)]


def test_lt_devices_as_lightning_passes_it_through(lightning_cli: Any) -> None:
    lightning_cli(cli_used="1", devices="auto", num_nodes="1")
    assert Fabric(accelerator="cpu", devices=1).world_size == 1  # 'auto' from the command agrees with anything
    lightning_cli(devices="2")
    with pytest.raises(ValueError, match=re.escape("Fabric(devices=3) contradicts 'fabric run --devices 2'")):
        Fabric(accelerator="cpu", devices=3)


def test_garbled_lt_count_names_the_lt_variable(lightning_cli: Any) -> None:
    lightning_cli(cli_used="1", num_nodes="two")
    with pytest.raises(ValueError, match=re.escape("LT_NUM_NODES='two': `fabric run` sets this to a count")):
        Fabric(accelerator="cpu")


@pytest.fixture
def torchrun_world_of_one(monkeypatch: pytest.MonkeyPatch, under_cli: Any) -> None:
    """What `fabric run --accelerator cpu --strategy ddp` gives a process: torchrun's variables and the CLI's."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    under_cli(accelerator="cpu", strategy="ddp", devices="1", num_nodes="1")


def test_under_cli_a_script_without_launch_works(torchrun_world_of_one: None) -> None:
    fabric = Fabric()
    assert isinstance(fabric.strategy, DDPStrategy)
    assert fabric.strategy.requires_launch
    assert fabric.all_reduce(torch.tensor(2.0), reduce_op="sum").item() == 2.0
    assert fabric.world_size == 1


def test_under_cli_launch_only_joins_the_group(torchrun_world_of_one: None) -> None:
    fabric = Fabric()
    assert fabric.launch() is None
    assert fabric.strategy.launcher is None
    assert fabric.all_reduce(torch.tensor(3.0), reduce_op="sum").item() == 3.0


def test_without_cli_ddp_still_needs_launch(monkeypatch: pytest.MonkeyPatch, under_cli: Any) -> None:
    under_cli()
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    with pytest.raises(RuntimeError, match=re.escape("fabric.barrier() was called before fabric.launch()")):
        fabric.barrier()


# -- fabric consolidate ------------------------------------------------------------------------------
@pytest.fixture
def sharded_dir(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    import warnings

    from fabric.checkpoint import sharded as _sharded_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it runs without a process group
        _sharded_checkpoint.save_sharded(tmp_path / "ckpt", {"model": model, "step": 4}, None, 1, 0, lambda: None)
    return tmp_path / "ckpt", model


def test_consolidate_as_a_subprocess_writes_a_file_torch_load_reads(sharded_dir: tuple[Path, Any]) -> None:
    import subprocess
    import sys

    folder, model = sharded_dir
    output = folder.parent / "model.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "fabric", "consolidate", str(folder), str(output)],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"wrote {output}" in done.stdout
    whole = torch.load(output)
    assert whole["step"] == 4
    plain = torch.nn.Linear(3, 2)
    plain.load_state_dict(whole["model"])
    assert torch.equal(plain.weight, model.weight) and torch.equal(plain.bias, model.bias)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["ckpt", "model.pt"], "no temporary file left"


def test_consolidate_refuses_to_overwrite_unless_forced(
    sharded_dir: tuple[Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = sharded_dir[0]
    output = folder.parent / "model.pt"
    output.write_text("precious")
    assert cli.main(["consolidate", str(folder), str(output)]) == 2
    assert "already exists, and consolidating would replace it" in capsys.readouterr().err
    assert output.read_text() == "precious"
    assert cli.main(["consolidate", "--force", str(folder), str(output)]) == 0
    assert torch.load(output)["step"] == 4


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda folder: folder / "missing", "no checkpoint exists at this path"),
        (lambda folder: ((folder / ".metadata").unlink(), folder)[1], r"incomplete: \.metadata is missing"),
        (lambda folder: ((folder / "__0_0.distcp").unlink(), folder)[1], "incomplete: missing files: __0_0.distcp"),
        (lambda folder: folder / ".metadata", "this is a file; only a sharded checkpoint directory"),
    ],
)
def test_consolidate_bad_input(
    sharded_dir: tuple[Path, Any], capsys: pytest.CaptureFixture[str], damage: Any, message: str
) -> None:
    source = damage(sharded_dir[0])
    output = sharded_dir[0].parent / "model.pt"
    assert cli.main(["consolidate", str(source), str(output)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fabric consolidate: consolidate(") and re.search(message, err), err
    assert not output.exists()


def test_consolidate_output_is_a_directory(sharded_dir: tuple[Path, Any], capsys: pytest.CaptureFixture[str]) -> None:
    folder = sharded_dir[0]
    assert cli.main(["consolidate", str(folder), str(folder.parent)]) == 2
    assert "is a directory. Name a file" in capsys.readouterr().err


def test_consolidate_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["consolidate", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "CHECKPOINT_DIR" in text and "OUTPUT_FILE" in text and "--force" in text


def test_one_machine_uses_the_loopback_rendezvous(script: Path, launched: list[list[str]]) -> None:
    # Its store then listens on 127.0.0.1 alone, whatever --main-address says: no other host needs it.
    port = _free_port()
    argv = ["run", "--accelerator", "cpu", "--devices", "2", "--main-address", "10.9.8.7", "--main-port", str(port)]
    assert cli.main([*argv, str(script)]) == 0
    assert launched[0][:5] == ["--nproc_per_node=2", "--nnodes=1", "--node_rank=0",
                               "--rdzv_backend=fabric-loopback", f"--rdzv_endpoint=127.0.0.1:{port}"]  # fmt: skip
