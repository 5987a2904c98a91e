"""The `fabric` command line: `run` starts a script's processes through torch's elastic launcher, with Fabric's flags
from the command; `consolidate` turns a sharded checkpoint into one file."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fabric._cli_argv import split_run_argv
from fabric._cli_flags import CLI_ENV_PREFIX, LIGHTNING_CLI_USED, LIGHTNING_ENV_PREFIX
from fabric.precision._names import PRECISIONS
from fabric.strategies import STRATEGY_REGISTRY
from fabric.strategies.launchers.fabric_run import LOOPBACK_RENDEZVOUS, worker_command

ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "auto")
LEGACY_PRECISIONS = ("32", "64", "16", "bf16")
DEFAULT_DEVICES = "1"  # like `lightning run model`: one process unless asked, never all GPUs by surprise
DEFAULT_MAIN_PORT = 29400
LOOPBACK = "127.0.0.1"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int; pass a whole number such as 1 or 2") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 or more (the number of machines)")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int; pass a whole number such as 0 or 1") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port; pass a number from 1 to 65535")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The `fabric` command line: the sub-commands `run` and `consolidate`."""
    parser = argparse.ArgumentParser(prog="fabric", description="Command-line tools for fabric.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        prog="fabric run",
        allow_abbrev=False,  # like Lightning's click CLI: `--dev` after SCRIPT is the script's, so never ours
        help="Run a training script on one or more processes, devices and machines.",
        description=(
            "Start SCRIPT once per device through torch.distributed.run (torchrun). The script's Fabric(...) "
            "takes every flag it leaves at its default from this command; a flag set in both places must agree. "
            "Its options may stand before or after SCRIPT, as in Lightning's CLI; every other argument, and "
            "everything after `--`, is passed to the script in order."
        ),
    )
    run.add_argument("script", metavar="SCRIPT", help="The Python script to run in every process.")
    run.add_argument(
        "script_args",
        metavar="SCRIPT_ARGS",
        nargs="*",
        help="Arguments passed to the script as-is: every word after SCRIPT that is not an option above, and "
        "everything after `--` (put a script option spelled like one above there).",
    )
    run.add_argument(
        "--accelerator",
        type=str.lower,
        choices=ACCELERATORS,
        default="auto",
        help="The hardware to run on; 'auto' picks CUDA, then MPS, then the CPU. Default: %(default)s.",
    )
    strategies = ["auto", *STRATEGY_REGISTRY.names()]
    run.add_argument(
        "--strategy",
        type=str.lower,
        choices=strategies,
        default="auto",
        metavar="NAME",
        help=(
            "How work is distributed across the processes, by registered name: "
            f"{', '.join(strategies)}. Default: %(default)s."
        ),
    )
    run.add_argument(
        "--devices",
        default=DEFAULT_DEVICES,
        help=(
            "Devices (= processes) per machine: a count such as 2, a GPU list such as 0,1, -1 for all, or "
            "'auto' for the accelerator's own count (1 on the CPU, every GPU on CUDA). Default: %(default)s."
        ),
    )
    run.add_argument(
        "--num-nodes",
        type=_positive_int,
        default=1,
        help="The number of machines taking part; start this command once on each. Default: %(default)s.",
    )
    run.add_argument(
        "--node-rank",
        type=_non_negative_int,
        default=0,
        help="This machine's rank, from 0 to num-nodes - 1; rank 0 hosts the rendezvous. Default: %(default)s.",
    )
    run.add_argument(
        "--main-address",
        default="127.0.0.1",
        help="Address of the node-rank-0 machine, reachable from every machine. Default: %(default)s.",
    )
    run.add_argument(
        "--main-port",
        type=_port,
        default=DEFAULT_MAIN_PORT,
        help="A free TCP port on the node-rank-0 machine for the rendezvous. Default: %(default)s.",
    )
    run.add_argument(
        "--precision",
        type=str.lower,
        choices=[*PRECISIONS, *LEGACY_PRECISIONS],
        default=None,
        help="The numeric policy; unset leaves it to the script (which defaults to 32-true). Default: unset.",
    )
    _add_lightning_spellings(run)
    _add_consolidate(commands)
    return parser


def _add_lightning_spellings(run: argparse.ArgumentParser) -> None:
    """Lightning's `fabric run` also accepts --num_nodes, --node_rank, ...; hidden here to keep --help short."""
    for action in list(run._actions):
        dashed = next((o for o in action.option_strings if o.startswith("--") and "-" in o[2:]), None)
        if dashed is None:
            continue
        options: dict[str, Any] = {"type": action.type} if action.type is not None else {}
        run.add_argument(
            "--" + dashed[2:].replace("-", "_"),
            dest=action.dest,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
            **options,
        )


def _add_consolidate(commands: Any) -> None:
    consolidate = commands.add_parser(
        "consolidate",
        prog="fabric consolidate",
        help="Turn a sharded checkpoint directory into one file that torch.load reads.",
        description=(
            "Read a sharded (torch.distributed.checkpoint) checkpoint directory, written by any number of "
            "processes, in this one process and write its whole content as one torch.save file of plain tensors. "
            "Needs memory for the whole checkpoint; no GPU and no process group."
        ),
    )
    consolidate.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="The sharded checkpoint directory.")
    consolidate.add_argument("output", metavar="OUTPUT_FILE", help="The file to write (atomically).")
    consolidate.add_argument(
        "--force", action="store_true", help="Replace OUTPUT_FILE if it exists. Default: refuse to overwrite it."
    )
    consolidate.add_argument(
        "--weights-only",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "Unpickle only tensors and plain Python values, never objects whose loading could run code. "
            "--no-weights-only reads any pickled object: use it only for checkpoints you trust. Default: on."
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fabric` console script and of `python -m fabric`."""
    parser = build_parser()
    args = parse_args(parser, list(sys.argv[1:] if argv is None else argv))
    if args.command == "consolidate":
        return _consolidate(args)
    try:
        return _run(args)
    except _CLIError as err:
        print(f"fabric run{err.flags}: {err}", file=sys.stderr)
        return 2


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse `argv`; for `run`, its options before or after SCRIPT and the script's arguments (see _cli_argv)."""
    if not argv or argv[0] != "run":
        return parser.parse_args(argv)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    ours, script_args = split_run_argv(commands.choices["run"], argv[1:])
    args = parser.parse_args(["run", *ours])
    args.script_args = script_args
    return args


class _CLIError(Exception):
    """Bad input found after parsing; the message follows the project's error shape."""

    def __init__(self, message: str, flags: str = "") -> None:
        super().__init__(message)
        self.flags = flags


def _run(args: argparse.Namespace) -> int:
    if not Path(args.script).is_file():
        raise _CLIError(
            f"script {args.script!r} does not exist. Check the path; a relative path is resolved against the "
            f"current directory ({Path.cwd()})."
        )
    if args.node_rank >= args.num_nodes:
        raise _CLIError(
            f"node rank {args.node_rank} does not exist among {args.num_nodes} machine(s). "
            f"Pass --node-rank from 0 to {args.num_nodes - 1}.",
            f" --num-nodes {args.num_nodes} --node-rank {args.node_rank}",
        )
    nproc, visible = process_layout(args.accelerator, args.devices)
    if args.num_nodes == 1:
        # No other machine needs the rendezvous: its store listens on loopback only (see torchrun_args).
        args.main_address = LOOPBACK
    if args.node_rank == 0:
        check_port_free(args.main_address, args.main_port)
    os.environ.update(cli_environment(args, nproc))
    os.environ.update(_thread_default(nproc))
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    return _torchrun(torchrun_args(args, nproc))


def process_layout(accelerator: str, devices: str) -> tuple[int, str | None]:
    """Processes per machine, and the CUDA_VISIBLE_DEVICES to set (None: leave it as it is)."""
    accel = _accelerator(accelerator)
    value: Any = devices
    if devices.strip().lstrip("-").isdigit() and "," not in devices:
        value = int(devices)
    try:
        indices = accel.parse_devices(value)
    except ValueError as err:
        why = str(err).split(": ", 1)[-1]
        raise _CLIError(why, f" --accelerator {accelerator} --devices {devices}") from None
    from fabric.accelerators.cuda import CUDAAccelerator

    if not isinstance(accel, CUDAAccelerator) or indices == list(range(len(indices))):
        return len(indices), None
    # Each process sees only the listed GPUs, renumbered from 0, so devices=N in the script picks them.
    already = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [p.strip() for p in already.split(",")] if already else [str(i) for i in range(max(indices) + 1)]
    return len(indices), ",".join(names[i] for i in indices)


def _accelerator(name: str) -> Any:
    from fabric.accelerators import ACCELERATOR_REGISTRY

    candidates = {"auto": ("cuda", "mps", "cpu"), "gpu": ("cuda", "mps")}.get(name, (name,))
    for candidate in candidates:
        factory, kwargs = ACCELERATOR_REGISTRY.get(candidate)
        if factory.is_available():  # type: ignore[attr-defined]
            return factory(**kwargs)
    raise _CLIError(
        f"no {'GPU' if name == 'gpu' else name.upper()} device is available on this machine. "
        "Use --accelerator cpu or auto.",
        f" --accelerator {name}",
    )


def check_port_free(address: str, port: int) -> None:
    """Fail now, with a clear message, when something already listens on the rendezvous port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR like torch's TCPStore: connections of an earlier run in TIME_WAIT do not block it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
            sock.listen(1)
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                return  # e.g. a name this check cannot bind to; torchrun reports its own error then
            raise _CLIError(
                f"port {port} on {address} is already in use. Choose a free port with --main-port (the same on "
                "every machine), or end the process that holds it.",
                f" --main-port {port}",
            ) from None


def cli_environment(args: argparse.Namespace, nproc: int) -> dict[str, str]:
    """The variables that carry the flags to Fabric(...) in every process: Lightning's LT_* and our FABRIC_CLI_*.

    Both sets are exported, so a script run by this command reads its flags whether it uses our Fabric or
    Lightning's. DEVICES is the process count: a GPU list is applied through CUDA_VISIBLE_DEVICES (see
    process_layout), so each process sees its GPUs renumbered from 0.
    """
    flags = {"ACCELERATOR": args.accelerator, "STRATEGY": args.strategy, "DEVICES": str(nproc),
             "NUM_NODES": str(args.num_nodes)}  # fmt: skip
    if args.precision is not None:
        flags["PRECISION"] = args.precision
    env = {CLI_ENV_PREFIX + name: value for name, value in flags.items()}
    # Lightning's CLI exports accelerator and strategy only when given; "auto" means the same as leaving them out,
    # and leaving them out keeps Lightning's Fabric from reading a code value such as "cpu" as a contradiction.
    lightning = {name: value for name, value in flags.items() if value != "auto"}
    env |= {LIGHTNING_ENV_PREFIX + name: value for name, value in lightning.items()}
    env[LIGHTNING_CLI_USED] = "1"
    return env


def _thread_default(nproc: int) -> dict[str, str]:
    """OMP_NUM_THREADS for the processes when the user has not set it: the CPUs shared among them.

    Lightning's CLI sets it so torchrun does not force 1 thread per process; it gives each process every CPU,
    which oversubscribes the machine with several processes, so here they share them.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"OMP_NUM_THREADS": str(max(1, cpus // max(1, nproc)))}


def torchrun_args(args: argparse.Namespace, nproc: int) -> list[str]:
    """The command line for torch.distributed.run; on one machine its rendezvous store listens on loopback only."""
    if args.num_nodes == 1:
        rendezvous = [f"--rdzv_backend={LOOPBACK_RENDEZVOUS}", f"--rdzv_endpoint={LOOPBACK}:{args.main_port}"]
    else:
        rendezvous = [f"--master_addr={args.main_address}", f"--master_port={args.main_port}"]
    return [
        f"--nproc_per_node={nproc}",
        f"--nnodes={args.num_nodes}",
        f"--node_rank={args.node_rank}",
        *rendezvous,
        *worker_command(args.script, args.script_args),
    ]


def _torchrun(torchrun_argv: list[str]) -> int:
    """Run torchrun in this process (it becomes the agent of its workers); its exit status, non-zero on failure."""
    from fabric.strategies.launchers.fabric_run import run_agent

    return run_agent(torchrun_argv)


def _read_whole(checkpoint: str, weights_only: bool) -> dict[str, Any]:
    """A torch.distributed.checkpoint directory or a DeepSpeed one, as one plain dict."""
    from fabric.checkpoint import sharded as _sharded_checkpoint
    from fabric.strategies.deepspeed import checkpoint as _deepspeed_checkpoint

    if _deepspeed_checkpoint.is_deepspeed_checkpoint(checkpoint):
        return _deepspeed_checkpoint.consolidate_deepspeed(checkpoint, weights_only)
    return _sharded_checkpoint.consolidate(checkpoint, weights_only)


def _check_output(output: str, force: bool) -> None:
    """OUTPUT_FILE (a local path or an fsspec URL) must be a file name, and new unless --force."""
    from fabric.io import _fsspec

    if _fsspec.is_url(output):
        fs, inner = _fsspec.filesystem(output, "consolidate")
        is_dir, exists = fs.isdir(inner), fs.exists(inner)
    else:
        local = _fsspec.local(output)
        is_dir, exists = local.is_dir(), local.exists()
    if is_dir:
        raise _CLIError(f"OUTPUT_FILE {output!r} is a directory. Name a file, such as model.pt.")
    if exists and not force:
        raise _CLIError(
            f"OUTPUT_FILE {output!r} already exists, and consolidating would replace it. Choose another "
            "name, or pass --force to replace it."
        )


def _consolidate(args: argparse.Namespace) -> int:
    """`fabric consolidate`: the checks that need no torch.distributed first, then the conversion."""
    import pickle

    try:
        try:
            _check_output(args.output, args.force)
            from fabric.io.torch_io import TorchCheckpointIO

            whole = _read_whole(args.checkpoint, args.weights_only)
            # TorchCheckpointIO publishes the file in one step: no half-written OUTPUT_FILE on failure.
            TorchCheckpointIO().save_checkpoint(whole, args.output)
        except (OSError, ValueError, RuntimeError, ImportError, pickle.UnpicklingError) as err:
            raise _CLIError(str(err)) from None
    except _CLIError as err:
        print(f"fabric consolidate: {err}", file=sys.stderr)
        return 2
    print(f"fabric consolidate: wrote {args.output} ({', '.join(map(str, whole))})")
    return 0
