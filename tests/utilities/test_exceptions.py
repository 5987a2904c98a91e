"""User errors derive from MisconfigurationException and keep their builtin type."""

from __future__ import annotations

import pytest
import torch

from fabric import Fabric
from fabric.utilities.exceptions import MisconfigurationException


def test_bad_strategy_name_is_both_a_value_error_and_a_misconfiguration() -> None:
    with pytest.raises(MisconfigurationException, match="unknown strategy 'ddp_spwan'"):
        Fabric(accelerator="cpu", strategy="ddp_spwan")
    with pytest.raises(ValueError, match="unknown strategy 'ddp_spwan'"):
        Fabric(accelerator="cpu", strategy="ddp_spwan")


def test_wrong_kind_of_object_is_both_a_type_error_and_a_misconfiguration() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(MisconfigurationException) as caught:
        fabric.setup_dataloaders(torch.zeros(3))
    assert isinstance(caught.value, TypeError)
