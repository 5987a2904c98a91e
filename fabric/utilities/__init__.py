"""Helpers shared by the strategies and the Fabric facade, and the ones Lightning Fabric exports for users."""

from fabric.utilities.apply_func import move_data_to_device
from fabric.utilities.data import AttributeDict, suggested_max_num_workers
from fabric.utilities.enums import LightningEnum
from fabric.utilities.rank_zero import rank_zero_deprecation, rank_zero_info, rank_zero_only, rank_zero_warn
from fabric.utilities.shared_filesystem import is_shared_filesystem
from fabric.utilities.throughput import Throughput, ThroughputMonitor, measure_flops
from fabric.utilities.warnings import disable_possible_user_warnings

__all__ = [
    "AttributeDict",
    "LightningEnum",
    "Throughput",
    "ThroughputMonitor",
    "disable_possible_user_warnings",
    "is_shared_filesystem",
    "measure_flops",
    "move_data_to_device",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
    "suggested_max_num_workers",
]
