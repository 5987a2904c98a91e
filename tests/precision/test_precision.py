"""Tests for the precision plugins: module conversion, input/output casting, autocast, dtype contexts, scaler."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch

from fabric import DoublePrecision, HalfPrecision, MixedPrecision, Precision


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    return model


def _float_dtypes(module: torch.nn.Module) -> set[torch.dtype]:
    tensors = [*module.parameters(), *module.buffers()]
    return {t.dtype for t in tensors if torch.is_floating_point(t)}


# -- module conversion -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("plugin", "dtype"),
    [
        (DoublePrecision(), torch.float64),
        (HalfPrecision("16-true"), torch.float16),
        (HalfPrecision("bf16-true"), torch.bfloat16),
    ],
)
def test_convert_module_casts_parameters_and_float_buffers(plugin: Precision, dtype: torch.dtype) -> None:
    model = plugin.convert_module(_model())
    assert _float_dtypes(model) == {dtype}
    # the integer batch counter of BatchNorm stays an integer
    assert model[1].num_batches_tracked.dtype == torch.int64


@pytest.mark.parametrize("plugin", [Precision(), MixedPrecision("bf16-mixed", device="cpu")])
def test_full_and_mixed_precision_leave_the_module_in_float32(plugin: Precision) -> None:
    model = _model()
    assert plugin.convert_module(model) is model
    assert _float_dtypes(model) == {torch.float32}


def test_precision_names() -> None:
    assert Precision().precision == "32-true"
    assert DoublePrecision().precision == "64-true"
    assert HalfPrecision().precision == "16-true"
    assert HalfPrecision("bf16-true").precision == "bf16-true"
    assert MixedPrecision("bf16-mixed", device="cpu").precision == "bf16-mixed"


# -- input / output conversion -------------------------------------------------------------------------
def _batch() -> dict[str, Any]:
    return {
        "x": torch.ones(2, dtype=torch.float32),
        "nested": [torch.arange(3), (torch.zeros(1, dtype=torch.float16), "label")],
        "mask": torch.tensor([True, False]),
        "ordered": OrderedDict(idx=torch.tensor([1, 2], dtype=torch.int32)),
        "count": 7,
    }


@pytest.mark.parametrize(
    ("plugin", "dtype"),
    [
        (DoublePrecision(), torch.float64),
        (HalfPrecision("16-true"), torch.float16),
        (HalfPrecision("bf16-true"), torch.bfloat16),
        (MixedPrecision("bf16-mixed", device="cpu"), torch.bfloat16),
    ],
)
def test_convert_input_casts_only_floating_tensors(plugin: Precision, dtype: torch.dtype) -> None:
    batch = _batch()
    out = plugin.convert_input(batch)
    assert out["x"].dtype == dtype
    assert out["nested"][1][0].dtype == dtype
    assert out["nested"][0] is batch["nested"][0]  # int64 tensor untouched, not even copied
    assert out["nested"][1][1] == "label"
    assert out["mask"] is batch["mask"]
    assert out["ordered"]["idx"] is batch["ordered"]["idx"]
    assert isinstance(out["ordered"], OrderedDict)
    assert out["count"] == 7
    assert torch.equal(out["x"].float(), batch["x"])


@pytest.mark.parametrize(
    "plugin", [DoublePrecision(), HalfPrecision("bf16-true"), MixedPrecision("bf16-mixed", device="cpu")]
)
def test_convert_output_goes_back_to_the_default_dtype(plugin: Precision) -> None:
    output = {"loss": torch.tensor(1.5, dtype=torch.float64), "pred": [torch.ones(2, dtype=torch.bfloat16)]}
    output["labels"] = torch.tensor([3, 4])
    out = plugin.convert_output(output)
    assert out["loss"].dtype == torch.float32
    assert out["pred"][0].dtype == torch.float32
    assert out["labels"] is output["labels"]
    assert out["loss"].item() == 1.5


def test_full_precision_hooks_are_identities() -> None:
    plugin = Precision()
    batch = _batch()
    assert plugin.convert_input(batch) is batch
    assert plugin.convert_output(batch) is batch
    assert not plugin.changes_forward
    assert not plugin.requires_fabric_backward
    assert not plugin.has_loss_scaler


# -- forward context -------------------------------------------------------------------------------------
def test_bf16_mixed_forward_context_autocasts_matmul_on_cpu() -> None:
    plugin = MixedPrecision("bf16-mixed", device="cpu")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with plugin.forward_context():
        product = a @ b
        total = a + b  # not on autocast's lower-precision list: stays float32
    assert product.dtype == torch.bfloat16
    assert total.dtype == torch.float32
    assert (a @ b).dtype == torch.float32  # autocast ended with the context


@pytest.mark.parametrize(
    ("plugin", "dtype"),
    [(DoublePrecision(), torch.float64), (HalfPrecision("16-true"), torch.float16)],
)
def test_true_precision_forward_context_sets_default_dtype(plugin: Precision, dtype: torch.dtype) -> None:
    with plugin.forward_context():
        assert torch.empty(1).dtype == dtype
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(
    ("plugin", "dtype"),
    [
        (DoublePrecision(), torch.float64),
        (HalfPrecision("16-true"), torch.float16),
        (HalfPrecision("bf16-true"), torch.bfloat16),
    ],
)
def test_tensor_init_context_restores_the_default_dtype(plugin: Precision, dtype: torch.dtype) -> None:
    with plugin.tensor_init_context():
        assert torch.get_default_dtype() == dtype
        assert torch.zeros(2).dtype == dtype
    assert torch.get_default_dtype() == torch.float32
    with plugin.module_init_context():
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.dtype == dtype
    assert torch.get_default_dtype() == torch.float32


def test_tensor_init_context_restores_the_dtype_after_an_error() -> None:
    with pytest.raises(KeyError), DoublePrecision().tensor_init_context():
        raise KeyError("boom")
    assert torch.get_default_dtype() == torch.float32


def test_tensor_init_context_restores_a_non_float32_default() -> None:
    torch.set_default_dtype(torch.float64)  # conftest restores it afterwards
    with HalfPrecision("bf16-true").tensor_init_context():
        assert torch.get_default_dtype() == torch.bfloat16
    assert torch.get_default_dtype() == torch.float64


# -- validation -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["32-true", "bf16", "16-true", "fp16"])
def test_mixed_precision_rejects_other_precisions(name: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"MixedPrecision\(precision='{name}'\): unsupported value. Use '16-mixed' or 'bf16-mixed'.",
    ):
        MixedPrecision(name, device="cpu")  # type: ignore[arg-type]


def test_mixed_precision_rejects_a_scaler_with_bf16() -> None:
    with pytest.raises(ValueError, match=r"MixedPrecision\(precision='bf16-mixed', scaler=...\): bfloat16 has"):
        MixedPrecision("bf16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("name", ["16-mixed", "bf16-true ", "64-true"])
def test_half_precision_rejects_other_precisions(name: str) -> None:
    with pytest.raises(ValueError, match=r"HalfPrecision\(precision=.*\): unsupported value. Use '16-true' or"):
        HalfPrecision(name)  # type: ignore[arg-type]


# -- scaler -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "device"), [("16-mixed", "cpu"), ("bf16-mixed", "cpu"), ("bf16-mixed", "cuda")])
def test_no_scaler_is_created_off_cuda_or_for_bf16(name: str, device: str) -> None:
    plugin = MixedPrecision(name, device=device)  # type: ignore[arg-type]
    assert plugin.scaler is None
    assert not plugin.requires_fabric_backward
    assert not plugin.has_loss_scaler
    assert plugin.state_dict() == {}


def test_16_mixed_autocasts_to_float16() -> None:
    plugin = MixedPrecision("16-mixed", device="cpu")
    with plugin.forward_context():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16


def _scaled_plugin(init_scale: float) -> MixedPrecision:
    return MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))


def test_a_given_scaler_is_used() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    assert plugin.scaler is scaler
    assert plugin.requires_fabric_backward
    assert plugin.has_loss_scaler


def test_scaler_state_dict_round_trip() -> None:
    source = _scaled_plugin(1024.0)
    state = source.state_dict()
    assert state["scale"] == 1024.0
    target = _scaled_plugin(2.0)
    target.load_state_dict(state)
    assert target.scaler is not None
    assert target.scaler.get_scale() == 1024.0
    assert target.state_dict() == state


def test_loading_an_empty_state_keeps_the_scale() -> None:
    plugin = _scaled_plugin(4.0)
    plugin.load_state_dict({})
    assert plugin.scaler is not None
    assert plugin.scaler.get_scale() == 4.0


def test_scaled_backward_multiplies_gradients_and_step_unscales() -> None:
    plugin = _scaled_plugin(8.0)
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    plugin.backward((weight * 3).sum(), None)
    assert torch.equal(weight.grad, torch.full((2,), 24.0))  # scaled by 8
    plugin.optimizer_step(optimizer)
    assert torch.equal(weight.detach(), torch.full((2,), -2.0))  # unscaled gradient 3 applied


def test_closure_with_scaler_is_rejected() -> None:
    plugin = _scaled_plugin(8.0)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    with pytest.raises(TypeError, match=r"optimizer.step\(closure=...\): a closure cannot be used"):
        plugin.optimizer_step(optimizer, closure=lambda: None)


def test_base_precision_state_dict_round_trip() -> None:
    plugin = Precision()
    assert plugin.state_dict() == {}
    plugin.load_state_dict({})
    assert plugin.state_dict() == {}


def test_deepspeed_precision_backward_goes_through_the_engine() -> None:
    from fabric.precision import DeepSpeedPrecision

    class _Engine(torch.nn.Module):  # a DeepSpeedEngine is a Module
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

        def backward(self, tensor: Any, *args: Any, **kwargs: Any) -> None:
            self.calls.append((tensor, args, kwargs))

    engine = _Engine()
    loss = torch.tensor(1.0, requires_grad=True)
    DeepSpeedPrecision("32-true").backward(loss, engine, retain_graph=True)
    assert engine.calls == [(loss, (), {"retain_graph": True})]
    assert loss.grad is None  # the engine alone back-propagates (it scales and reduces ZeRO's gradients)
    with pytest.raises(ValueError, match=r"backward\(tensor, None\).*Pass the engine"):
        DeepSpeedPrecision("32-true").backward(loss, None)
