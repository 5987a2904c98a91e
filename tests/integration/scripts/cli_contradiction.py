"""Started by `fabric run --precision 32-true`: sets another precision in code, which must fail clearly."""

from fabric import Fabric

Fabric(precision="bf16-mixed")
