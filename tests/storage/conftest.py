"""A running S3 server for the remote-storage tests: moto's server in this process, on
a free port of 127.0.0.1, for the whole session; each test gets a bucket of its own and
the s3fs storage options that reach it (passed explicitly, never through the
environment). s3fs caches its filesystems per process: the cache is cleared around each
test, so no test sees another's."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

#: The secret of the test credentials: a test checks that it is written nowhere.
SECRET = "loopbus-test-secret-8f3a"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server(port: int) -> Any:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


def options_for(endpoint: str) -> dict[str, Any]:
    """s3fs storage options for the server at ``endpoint``: dummy credentials, and
    botocore's own retries off (loopbus's retries are under test)."""
    return {
        "key": "loopbus-test-key",
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
    }


def make_bucket(endpoint: str) -> str:
    import boto3

    bucket = f"loopbus-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="loopbus-test-key",
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=bucket)
    return bucket


@dataclass
class S3:
    """One test's bucket: ``url`` (``s3://<bucket>/run``), the storage options, and an
    s3fs filesystem to look at it with (``keys()``: the objects under ``run/``)."""

    url: str
    bucket: str
    endpoint: str
    options: dict[str, Any]

    @property
    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.options)

    def keys(self, prefix: str = "run") -> list[str]:
        fs = self.fs
        found = fs.find(f"{self.bucket}/{prefix}")
        return sorted(k.split("/", 2)[2] if k.count("/") >= 2 else k for k in found)

    def grouped(self) -> dict[str, set[str]]:
        """The objects under ``run/``, grouped by the checkpoint (a sharded one's prefix)
        they are in; an object directly under ``run/`` holds ``{""}``."""
        found: dict[str, set[str]] = {}
        for key in self.keys():
            head, _, rest = key.partition("/")
            found.setdefault(head, set()).add(rest)
        return found


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    server = start_server(free_port())
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint: str) -> Iterator[S3]:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    bucket = make_bucket(s3_endpoint)
    yield S3(f"s3://{bucket}/run", bucket, s3_endpoint, options_for(s3_endpoint))
    s3fs.S3FileSystem.clear_instance_cache()
