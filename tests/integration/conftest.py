"""Integration tests share the process runner in scripts/, which the launched scripts also import."""

import sys
from pathlib import Path

# The scripts run as plain files in child processes, so they are not a package; put them on sys.path.
sys.path.insert(0, str(Path(__file__).parent / "scripts"))
