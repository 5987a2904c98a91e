"""A Hydra app that launches 2 DDP ranks with fabric.launch(); each rank leaves a marker in its run directory.

Usage: python hydra_app.py hydra.run.dir=RUNS/${now:%H-%M-%S-%f} [lr=...]
The run directory's name holds the microsecond, so a child that made a run of its own would make a second one.
The config is printed (on rank 0 only, as Lightning users do) before fabric.launch(), so in every process.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from _it_common import write_json
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from fabric import Fabric
from fabric.utilities.rank_zero import rank_zero_only

ConfigStore.instance().store(name="config", node={"lr": 0.1})


@rank_zero_only
def print_config(cfg: DictConfig) -> None:
    print(f"CONFIG {OmegaConf.to_yaml(cfg).strip()}", flush=True)


@hydra.main(version_base=None, config_name="config")
def main(cfg: DictConfig) -> None:
    print_config(cfg)
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    report = {"cwd": str(Path.cwd()), "lr": cfg.lr, "job": HydraConfig.get().job.name}
    write_json(run_dir / f"rank{fabric.global_rank}.json", report)
    fabric.barrier()


if __name__ == "__main__":
    main()
