"""Two real ranks (FSDP2 over gloo) save a sharded checkpoint to s3:// (a loopback moto server) and load it back;
then a plain single process loads the same URL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _it_runner as runner
import _s3_server
import pytest
import torch

pytestmark = pytest.mark.multiprocess
s3_bucket = _s3_server.s3_bucket  # the loopback S3 server fixture, shared with the unit tests


def _result(path: Path) -> dict[str, Any]:
    result = torch.load(path, weights_only=False)
    if "error" in result:
        pytest.fail(f"{path.name} raised:\n{result['error']}")
    return result


def test_two_ranks_save_and_load_a_sharded_checkpoint_on_s3(tmp_path: Path, s3_bucket: str) -> None:
    import s3fs

    url = f"{s3_bucket}/run/sharded"
    run = runner.run_script("shck_s3.py", str(tmp_path), url, timeout=240)
    assert run.returncode == 0, run.output
    rank0, rank1 = _result(tmp_path / "rank0.pt"), _result(tmp_path / "rank1.pt")
    for result in (rank0, rank1):
        assert result["step"] == 7
        for key, value in rank0["saved"].items():
            assert torch.equal(result["loaded"][key], value), key
    after = _result(tmp_path / "after.pt")
    assert after["remainder"] == {"optimizer": after["remainder"]["optimizer"], "step": 7}
    for key, value in rank0["saved"].items():
        assert torch.equal(after["loaded"][key], value), key
    fs = s3fs.S3FileSystem()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("fabric-test/run", detail=False))
    assert names == ["sharded"]  # no staging prefix left
    listing = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("fabric-test/run/sharded", detail=False))
    assert listing == [".metadata", "__0_0.distcp", "__1_0.distcp"]
