"""Lightning Fabric's module ``utilities.consolidate_checkpoint``: one file from a sharded checkpoint folder.

``python -m fabric.utilities.consolidate_checkpoint FOLDER [--output_file FILE]`` writes ``FOLDER.consolidated``
(or FILE), which ``torch.load`` reads. It is Lightning's command over fabric's own ``consolidate``; the
``fabric consolidate`` command does the same with fabric's options.
"""

from __future__ import annotations

import sys
from argparse import ArgumentParser, Namespace
from pathlib import Path


def _parse_cli_args(argv: list[str] | None = None) -> Namespace:
    parser = ArgumentParser(description="Convert a sharded checkpoint folder into one file torch.load reads.")
    parser.add_argument("checkpoint_folder", type=str, help="the folder a sharded save wrote")
    parser.add_argument("--output_file", type=str, help="where to write (default: FOLDER.consolidated)")
    return parser.parse_args(argv)


def _process_cli_args(args: Namespace) -> Namespace:
    """The folder and output file as paths; exits with status 1 and the reason when they cannot be used."""
    folder = Path(args.checkpoint_folder)
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is a file, not a sharded checkpoint folder"
        _fail(f"checkpoint_folder {str(folder)!r} {what}. Pass the folder a sharded save wrote.")
    output = Path(args.output_file) if args.output_file else folder.with_suffix(folder.suffix + ".consolidated")
    if output.exists():
        _fail(
            f"--output_file {str(output)!r} already exists, and consolidating would replace it. Pass another "
            "--output_file, or move the file first."
        )
    return Namespace(checkpoint_folder=folder, output_file=output)


def _fail(message: str) -> None:
    print(f"consolidate_checkpoint: {message}", file=sys.stderr)
    sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    from fabric.checkpoint.sharded import consolidate
    from fabric.io.torch_io import TorchCheckpointIO

    config = _process_cli_args(_parse_cli_args(argv))
    try:
        whole = consolidate(config.checkpoint_folder)
    except (OSError, ValueError, RuntimeError) as err:  # not a sharded checkpoint, unreadable, ...
        _fail(str(err))
    TorchCheckpointIO().save_checkpoint(whole, config.output_file)


if __name__ == "__main__":
    main()
