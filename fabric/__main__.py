"""`python -m fabric run ...`: the same as the `fabric` console script."""

import sys

from fabric.cli import main

if __name__ == "__main__":
    sys.exit(main())
