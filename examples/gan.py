"""A GAN on a toy 2-D distribution: two models and two optimizers, each pair set up with fabric.setup.

The real data are points around 8 modes on a circle. The printed "mode distance" is the mean distance of
generated points to their nearest mode: it falls as the generator learns to produce the real distribution.

Run:  python examples/gan.py --accelerator cpu --devices 2
      python examples/gan.py --accelerator cuda --devices 2 --precision bf16-mixed
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric

NOISE = 8
MODES = torch.tensor([[math.cos(2 * math.pi * k / 8), math.sin(2 * math.pi * k / 8)] for k in range(8)]) * 2.0


def make_points(n: int = 8192, seed: int = 0) -> TensorDataset:
    """Points scattered tightly around 8 modes on a circle of radius 2, the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    modes = MODES[torch.randint(0, len(MODES), (n,), generator=generator)]
    return TensorDataset(modes + 0.05 * torch.randn(n, 2, generator=generator))


def mlp(inputs: int, outputs: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, 128), nn.LeakyReLU(0.2), nn.Linear(128, 128), nn.LeakyReLU(0.2),
                         nn.Linear(128, outputs))  # fmt: skip


def mode_distance(points: Tensor) -> Tensor:
    """Mean distance from each point to its nearest mode (0 for a perfect generator)."""
    return torch.cdist(points.float(), MODES.to(points.device)).min(dim=1).values.mean()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Defaults that leave the choice to fabric (and to `fabric run`): 1 process on a CPU, every GPU on a GPU machine.
    parser.add_argument("--accelerator", default="auto", help="cpu, cuda, gpu, mps or auto")
    parser.add_argument("--strategy", default="auto", help="e.g. ddp, ddp_spawn; auto: ddp for several devices")
    parser.add_argument("--devices", default="auto", help="how many devices (processes on a CPU)")
    parser.add_argument("--precision", default=None, help="e.g. bf16-mixed, 16-mixed; default: 32-true")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    fabric = Fabric(
        accelerator=args.accelerator, strategy=args.strategy, devices=args.devices, precision=args.precision
    )
    fabric.launch()
    fabric.seed_everything(42)

    generator, discriminator = mlp(NOISE, 2), mlp(2, 1)
    # betas=(0.5, 0.999): the usual GAN setting; a smaller first moment keeps the two players from overshooting.
    opt_g = torch.optim.Adam(generator.parameters(), lr=args.lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=args.lr, betas=(0.5, 0.999))
    generator, opt_g = fabric.setup(generator, opt_g)
    discriminator, opt_d = fabric.setup(discriminator, opt_d)
    loader = fabric.setup_dataloaders(DataLoader(make_points(), batch_size=args.batch_size, shuffle=True))
    bce = nn.BCEWithLogitsLoss()
    fixed_noise = torch.randn(1024, NOISE, device=fabric.device)

    with torch.no_grad():
        fabric.print(f"before training: mode distance {mode_distance(generator(fixed_noise)).item():.4f}")
    for epoch in range(args.epochs):
        for (real,) in loader:
            fake = generator(torch.randn(real.shape[0], NOISE, device=fabric.device))

            # Discriminator step: real points are 1, generated ones 0. One forward over both halves, because
            # DDP expects one forward per backward; detach() keeps this step's gradient out of the generator.
            logits = discriminator(torch.cat([real, fake.detach()]))
            labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(fake), 1)]).to(logits)
            loss_d = bce(logits, labels)
            opt_d.zero_grad()
            fabric.backward(loss_d)
            opt_d.step()

            # Generator step: make the discriminator call the generated points real. This backward also fills
            # the discriminator's gradients; opt_d.zero_grad() above clears them before they are ever used.
            loss_g = bce(discriminator(fake), torch.ones(len(fake), 1, device=fabric.device))
            opt_g.zero_grad()
            fabric.backward(loss_g)
            opt_g.step()

        losses = fabric.all_reduce(torch.stack([loss_d.detach(), loss_g.detach()]).float(), reduce_op="mean")
        with torch.no_grad():
            distance = mode_distance(generator(fixed_noise))
        fabric.print(f"epoch {epoch}: loss_d {losses[0]:.4f}, loss_g {losses[1]:.4f}, mode distance {distance:.4f}")


if __name__ == "__main__":
    main()
