"""Children of a Hydra app (`@hydra.main`) join the parent's run instead of starting runs of their own.

Re-running the script in a child would make Hydra create a new run directory (its name is the time, so usually
another one), write `.hydra/config.yaml` again, and log to the parent's log file. Like Lightning's subprocess
launcher, the children get overrides that keep them in the parent's directory, write no config, and log to a file
of their own, and they start in the directory the parent started in (Hydra may have moved the parent into its run
directory). Costs nothing unless the script imported hydra itself.
"""

from __future__ import annotations

import sys


def child_overrides(local_rank: int) -> tuple[list[str], str | None]:
    """(Hydra overrides to append to a child's command, the directory to start it in); ([], None) outside Hydra."""
    if "hydra" not in sys.modules:  # never import hydra for a script that does not use it
        return [], None
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd

    if not HydraConfig.initialized():
        return [], None
    config = HydraConfig.get()
    # Quoted, so a directory name with spaces or Hydra's special characters stays one value.
    run_dir = config.runtime.output_dir.replace("\\", "\\\\").replace('"', '\\"')
    # The job name (so the log file) is Lightning's, so logs land where Lightning users look for them.
    overrides = [f'hydra.run.dir="{run_dir}"', f"hydra.job.name=train_ddp_process_{local_rank}",
                 "hydra.output_subdir=null"]  # fmt: skip
    return overrides, get_original_cwd()
