"""A local S3-compatible server (moto, on 127.0.0.1) for tests of s3:// paths; loopback only, fake credentials.

Imported by the conftest files of the test folders that use it (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def s3_bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A moto S3 server on loopback, reached through the standard AWS environment variables."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install torchfabric[s3])")
    server_module = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    port = _free_port()
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ENDPOINT_URL_S3": endpoint,
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    fs.makedirs("fabric-test", exist_ok=True)
    try:
        yield "s3://fabric-test"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        # moto keeps its buckets in process-wide state, across servers: empty it for the next test.
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=30)
        server.stop()
