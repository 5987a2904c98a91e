"""A Fabric subclass that overrides run(), launched with ddp_spawn on 2 CPU processes; prints rank 0's result."""

from __future__ import annotations

import torch

from fabric import Fabric


class MyFabric(Fabric):
    def run(self, scale: float, offset: float = 0.0) -> tuple[int, float]:
        total = self.all_reduce(torch.tensor(float(self.global_rank + 1)) * scale, reduce_op="sum")
        return self.global_rank, total.item() + offset


if __name__ == "__main__":
    print("result", MyFabric(accelerator="cpu", strategy="ddp_spawn", devices=2).run(2.0, offset=1.0))
