"""Print the requirements of this project and the extras named on the command line, one per line.

.ci/xla_stage installs these into the torch 2.9 environment in the background, before the project itself is installed
there (its editable install writes the package's metadata into the source tree, as the first stage's may be doing).
Extras that name the project itself (`torchfabric[docs,s3]`) are expanded here.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

PROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]


def requirements(extras: list[str], seen: set[str]) -> list[str]:
    found: list[str] = []
    for extra in extras:
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in PROJECT["optional-dependencies"][extra]:
            own = re.fullmatch(rf"{PROJECT['name']}\[(.+)\]", requirement)
            found += requirements(own.group(1).split(","), seen) if own else [requirement]
    return found


if __name__ == "__main__":
    print("\n".join([*PROJECT["dependencies"], *requirements(sys.argv[1:], set())]))
