"""DeepSpeedStrategy without processes: config merging, contradictions, precision mapping, registry, lazy import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fabric import Fabric
from fabric.precision import DeepSpeedPrecision, MixedPrecision
from fabric.strategies import STRATEGY_REGISTRY, DeepSpeedStrategy
from fabric.strategies.deepspeed import checkpoint as ckpt
from fabric.strategies.deepspeed.config import get_path


def test_defaults_without_config_are_lightnings() -> None:
    config = DeepSpeedStrategy().config
    assert config["zero_optimization"]["stage"] == 2
    assert config["zero_allow_untested_optimizer"] is True
    assert config["train_micro_batch_size_per_gpu"] == 1
    assert config["zero_optimization"]["reduce_bucket_size"] == 200_000_000
    assert "offload_optimizer" not in config["zero_optimization"]


def test_offload_keywords_fill_the_offload_sections() -> None:
    config = DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True, pin_memory=True).config
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "buffer_count": 4}
    assert zero["offload_param"]["device"] == "cpu"


def test_zero_optimization_false_means_stage_0() -> None:
    assert DeepSpeedStrategy(zero_optimization=False).zero_stage == 0


def test_config_is_kept_and_keywords_fill_what_it_lacks(tmp_path: Path) -> None:
    user = {"zero_optimization": {"stage": 3, "overlap_comm": False}, "gradient_clipping": 1.0}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    for config in (user, path, str(path)):
        strategy = DeepSpeedStrategy(config=config, stage=3, reduce_bucket_size=1000)
        assert strategy.config["zero_optimization"] == {"stage": 3, "overlap_comm": False, "reduce_bucket_size": 1000}
        assert strategy.config["gradient_clipping"] == 1.0
        # No Lightning defaults are added to a user's config, beyond the batch size DeepSpeed insists on.
        assert "zero_allow_untested_optimizer" not in strategy.config
    assert user == {"zero_optimization": {"stage": 3, "overlap_comm": False}, "gradient_clipping": 1.0}  # not mutated


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"stage": 3},
            "DeepSpeedStrategy(stage=3, config['zero_optimization']['stage']=2): the keyword and the config",
        ),
        ({"overlap_comm": True}, "DeepSpeedStrategy(overlap_comm=True, config['zero_optimization']['overlap_comm']"),
        ({"offload_optimizer": False}, "DeepSpeedStrategy(offload_optimizer=False, config['zero_optimization']"),
        ({"zero_optimization": False}, "DeepSpeedStrategy(stage=0, config['zero_optimization']['stage']=2)"),
    ],
)
def test_a_keyword_that_contradicts_the_config_names_both(kwargs: dict, message: str) -> None:
    config = {"zero_optimization": {"stage": 2, "overlap_comm": False, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ValueError, match=_escaped(message)):
        DeepSpeedStrategy(config=config, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, "DeepSpeedStrategy(stage=4): ZeRO has stages 0, 1, 2 and 3"),
        ({"zero_optimization": False, "stage": 2}, "DeepSpeedStrategy(zero_optimization=False, stage=2)"),
        ({"offload_parameters": True}, "DeepSpeedStrategy(offload_parameters=True, stage=2): parameters can only"),
        ({"bucket": 1}, "DeepSpeedStrategy(bucket=...): unknown keyword"),
    ],
)
def test_bad_keywords(kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=_escaped(message)):
        DeepSpeedStrategy(**kwargs)


def test_bad_config_values(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no such file\. Pass the path to a DeepSpeed JSON config"):
        DeepSpeedStrategy(config=tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        DeepSpeedStrategy(config=broken)
    with pytest.raises(TypeError, match=r"DeepSpeedStrategy\(config=int\): expected a dict or the path"):
        DeepSpeedStrategy(config=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("precision", "section"),
    [("32-true", None), ("bf16-mixed", "bf16"), ("bf16-true", "bf16"), ("16-true", "fp16"), ("16-mixed", "bf16")],
)
def test_precision_maps_to_deepspeeds_section(precision: str, section: str | None, no_cluster_env: None) -> None:
    # On the CPU, 16-mixed falls back to bf16-mixed (with a warning), as for every strategy.
    with pytest.warns(UserWarning) if precision == "16-mixed" else _nothing():
        fabric = Fabric(accelerator="cpu", devices=2, strategy="deepspeed", precision=precision)
    config = fabric.strategy.config  # type: ignore[attr-defined]
    for name in ("fp16", "bf16"):
        assert bool(get_path(config, (name, "enabled"))) == (name == section)
    if section == "fp16":
        assert config["fp16"]["initial_scale_power"] == 16  # loss-scaling defaults only with fp16


def test_unsupported_precision_is_an_error(no_cluster_env: None) -> None:
    with pytest.raises(ValueError, match=r"precision='64-true'\): DeepSpeed cannot train in this precision"):
        Fabric(accelerator="cpu", devices=2, strategy="deepspeed", precision="64-true")


def test_config_and_precision_that_disagree_name_both(no_cluster_env: None) -> None:
    strategy = DeepSpeedStrategy(config={"fp16": {"enabled": True}})
    with pytest.raises(ValueError, match=r"config=\{'fp16': \{'enabled': True\}\}\), precision='bf16-mixed'\)"):
        Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed")


def test_a_precision_name_becomes_a_deepspeed_precision(no_cluster_env: None) -> None:
    strategy = Fabric(accelerator="cpu", devices=2, strategy="deepspeed", precision="bf16-true").strategy
    assert isinstance(strategy.precision, DeepSpeedPrecision) and strategy.precision.precision == "bf16-true"
    default = Fabric(accelerator="cpu", devices=2, strategy="deepspeed").strategy.precision
    assert isinstance(default, DeepSpeedPrecision) and default.precision == "32-true"


def test_a_deepspeed_precision_plugin_configures_the_engine(no_cluster_env: None) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="deepspeed", plugins=[DeepSpeedPrecision("bf16-mixed")])
    assert fabric.strategy.config["bf16"] == {"enabled": True}  # type: ignore[attr-defined]
    assert "fp16" not in fabric.strategy.config  # type: ignore[attr-defined]


def test_another_precision_plugin_is_refused(no_cluster_env: None) -> None:
    plugin = MixedPrecision("bf16-mixed", device="cpu")
    with pytest.raises(TypeError, match=_escaped("plugins=[MixedPrecision]): DeepSpeed casts the model and scales")):
        Fabric(accelerator="cpu", devices=2, strategy="deepspeed", plugins=[plugin])


@pytest.mark.parametrize(
    ("precision", "fp16", "bf16"),
    [("32-true", False, False), ("bf16-mixed", False, True), ("16-true", True, False), ("bf16-true", False, True)],
)
def test_auto_sections_follow_the_precision(precision: str, fp16: bool, bf16: bool, no_cluster_env: None) -> None:
    # HF Accelerate / Transformers configs say "auto"; a non-empty string must not count as enabled.
    for key in ("bf16", "bfloat16"):
        config = {"fp16": {"enabled": "auto", "loss_scale": 0}, key: {"enabled": "auto"}}
        strategy = DeepSpeedStrategy(config=config)
        Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)
        assert strategy.config["fp16"]["enabled"] is fp16
        assert strategy.config[key]["enabled"] is bf16
        assert strategy.config["fp16"]["loss_scale"] == 0  # the rest of the section is the user's


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four CUDA devices as torch's public functions report them; nothing touches a real GPU before launch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize(
    ("devices", "visible", "fix"),
    [
        ([1], None, "CUDA_VISIBLE_DEVICES=1 and pass devices=1"),
        ([2, 3], None, "CUDA_VISIBLE_DEVICES=2,3 and pass devices=2"),
        ("1,2", "4,5,6,7", "CUDA_VISIBLE_DEVICES=5,6 and pass devices=2"),
    ],
)
def test_chosen_gpu_indices_are_refused_with_the_visible_devices_fix(
    devices: object, visible: str | None, fix: str, fake_gpus: None, no_cluster_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(ValueError, match=r"DeepSpeed places local rank i on cuda:i and cannot use other GPU") as err:
        Fabric(accelerator="cuda", devices=devices, strategy="deepspeed")
    assert str(err.value).endswith(f"start with {fix}.")


def test_the_first_gpus_are_what_deepspeed_uses(fake_gpus: None, no_cluster_env: None) -> None:
    for devices in (2, [0, 1], "0,1"):
        strategy = Fabric(accelerator="cuda", devices=devices, strategy="deepspeed").strategy
        assert strategy.parallel_devices == [torch.device("cuda", 0), torch.device("cuda", 1)]  # type: ignore


@pytest.mark.parametrize(
    ("precision", "method", "message"),
    [
        ("16-true", "is_fp16_supported", "accelerator has no float16 support on this machine. Use precision='bf16"),
        ("bf16-mixed", "is_bf16_supported", "accelerator has no bfloat16 support on this machine. Use precision='16"),
    ],
)
def test_a_dtype_deepspeed_lacks_here_is_named_at_launch(
    precision: str, method: str, message: str, no_cluster_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), method, lambda self: False)
    fabric = Fabric(accelerator="cpu", devices=1, strategy="deepspeed", precision=precision)
    with pytest.raises(RuntimeError, match=_escaped(f"precision={precision!r}): DeepSpeed's 'cpu' {message}")):
        fabric.launch()


def test_registry_names(no_cluster_env: None) -> None:
    expected = {
        "deepspeed": (2, False, False),
        "deepspeed_stage_1": (1, False, False),
        "deepspeed_stage_2": (2, False, False),
        "deepspeed_stage_2_offload": (2, True, False),
        "deepspeed_stage_3": (3, False, False),
        "deepspeed_stage_3_offload": (3, True, True),
    }
    for name, (stage, optimizer, params) in expected.items():
        assert name in STRATEGY_REGISTRY
        strategy = Fabric(accelerator="cpu", devices=2, strategy=name).strategy
        assert isinstance(strategy, DeepSpeedStrategy)
        assert strategy.zero_stage == stage
        assert strategy.requires_joint_setup
        zero = strategy.config["zero_optimization"]
        assert ("offload_optimizer" in zero, "offload_param" in zero) == (optimizer, params)


def test_setup_optimizer_alone_explains_the_joint_call() -> None:
    with pytest.raises(RuntimeError, match=r"Call model, optimizer = fabric.setup\(model, optimizer\)"):
        DeepSpeedStrategy().setup_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))


def test_building_the_strategy_does_not_import_deepspeed() -> None:
    code = (
        "import sys\n"
        "from fabric import Fabric\n"
        "Fabric(accelerator='cpu', devices=2, strategy='deepspeed_stage_3', precision='bf16-mixed')\n"
        "print('deepspeed' in sys.modules)"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_checkpoint_helpers_recognise_and_reject_directories(tmp_path: Path) -> None:
    assert not ckpt.is_deepspeed_checkpoint(tmp_path)
    assert not ckpt.is_deepspeed_checkpoint(tmp_path / "missing")
    (tmp_path / "latest").write_text("checkpoint")
    (tmp_path / "checkpoint").mkdir()
    assert not ckpt.is_deepspeed_checkpoint(tmp_path)
    torch.save({"dp_world_size": 2, "ds_config": {"zero_optimization": {"stage": 2}}},
               tmp_path / "checkpoint" / "mp_rank_00_model_states.pt")  # fmt: skip
    assert ckpt.is_deepspeed_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"the file of rank 0 .* is missing\. Copy the complete checkpoint"):
        ckpt.consolidate_deepspeed(tmp_path)
    with pytest.raises(ValueError, match="not a DeepSpeed checkpoint directory"):
        ckpt.consolidate_deepspeed(tmp_path / "checkpoint")
    with pytest.raises(FileNotFoundError, match=r"consolidate\(.*\): no such checkpoint"):
        ckpt.consolidate_deepspeed(tmp_path / "missing")


def test_consolidating_a_checkpoint_without_zero_needs_no_deepspeed(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("checkpoint")
    (tmp_path / "checkpoint").mkdir()
    weights = {"w": torch.ones(2, dtype=torch.bfloat16), "n": torch.tensor(3)}
    states = {"module": weights, "dp_world_size": 2, "ds_config": {}, "_fabric_module_key": "net", "step": 7}
    torch.save(states, tmp_path / "checkpoint" / "mp_rank_00_model_states.pt")
    result = ckpt.consolidate_deepspeed(tmp_path)
    assert set(result) == {"net", "step"} and result["step"] == 7
    assert result["net"]["w"].dtype == torch.float32 and result["net"]["n"].dtype == torch.int64


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def _nothing() -> object:
    from contextlib import nullcontext

    return nullcontext()
