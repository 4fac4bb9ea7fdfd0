"""A real S3-compatible server on localhost for tests: moto's server mode, plus a flaky proxy.

The fixtures reach every test through tests/conftest.py (`pytest_plugins`):

    def test_x(s3_bucket):            # "s3://forja-test-<hex>", a new empty bucket
        ...
    def test_y(flaky_s3):             # flaky_s3.url: a bucket behind a proxy that fails requests
        flaky_s3.share = 0.2          # 1 in 5 requests answered 503 or reset (seeded, so repeatable)
        ...

One moto server serves the whole session (it starts in about a second); each test gets its own
bucket and its own environment: AWS_ENDPOINT_URL pointing at the server (or the proxy), dummy
credentials and region, no ~/.aws files and no instance-metadata lookups (a missing-credentials
test would otherwise wait on 169.254.169.254). forja's filesystem cache and s3fs's instance
cache are cleared around each test, so no client outlives the endpoint it was built for.

Retries: forja's filesystems send each request once below forja (botocore and s3fs retries
turned down; see forja/storage/fs.py), so the failures the proxy injects reach forja's own
`retrying` and are what these tests exercise.
"""

from __future__ import annotations

import http.client
import logging
import random
import socket
import struct
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

REGION = "us-east-1"
# Headers that describe one hop, not the message; the proxy sets its own.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
        "content-length"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """The URL of a moto S3 server on a free localhost port, for the whole session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def _clear_clients() -> None:
    from forja.storage import clear_cache

    clear_cache()
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
    except ImportError:
        pass


def set_s3_env(monkeypatch: pytest.MonkeyPatch, endpoint: str, tmp_path) -> None:
    """Point boto at `endpoint` with dummy credentials, ignoring the user's own AWS setup."""
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("FORJA_STORAGE_BACKOFF_S", "0.01")  # read per call: retries wait little in tests
    _clear_clients()


def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import os

    if not os.environ.get("FORJA_CACHE", "").startswith(str(tmp_path)):
        monkeypatch.setenv("FORJA_CACHE", str(tmp_path / "forja-cache"))


def make_bucket(endpoint: str) -> str:
    """Create a fresh bucket on the server at `endpoint` directly (no proxy); its name."""
    import boto3

    name = f"forja-test-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION,
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_bucket(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> Iterator[str]:
    """"s3://<bucket>": a new empty bucket on the session's moto server, the environment set
    (FORJA_CACHE too, unless the test set it: the blocks read from the store stay in the test's
    own directory, not in ~/.cache/forja)."""
    set_s3_env(monkeypatch, moto_endpoint, tmp_path)
    _private_cache(monkeypatch, tmp_path)
    yield f"s3://{make_bucket(moto_endpoint)}"
    _clear_clients()


@dataclass
class FlakyProxy:
    """An HTTP proxy in front of the moto server that fails a share of the requests it gets:
    answered 503 Slow Down, or the connection reset without an answer (alternately, as a seeded
    generator picks). `failed` counts the failures injected, `forwarded` the requests passed on."""

    target: str  # host:port of the moto server
    share: float = 0.2
    seed: int = 0
    failed: int = 0
    forwarded: int = 0
    url: str = ""
    endpoint: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self._rng.seed(self.seed)

    def decide(self) -> str:
        """"pass", "503" or "reset" for the next request."""
        with self._lock:
            if self._rng.random() >= self.share:
                self.forwarded += 1
                return "pass"
            self.failed += 1
            return "503" if self._rng.random() < 0.5 else "reset"


def _handler(proxy: FlakyProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return data
                    data += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _any(self) -> None:
            body = self._body()  # read first, so a refused upload does not break the connection early
            verdict = proxy.decide()
            if verdict == "reset":
                # SO_LINGER 0: close with a TCP reset, as a dropped connection looks to a client
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()
                return
            if verdict == "503":
                payload = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                           b"<Message>Please reduce your request rate.</Message></Error>")
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload if self.command != "HEAD" else b"")
                return
            host, port = proxy.target.rsplit(":", 1)
            upstream = http.client.HTTPConnection(host, int(port), timeout=30)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            headers["Content-Length"] = str(len(body))
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            self.send_response_only(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() not in _HOP:
                    self.send_header(key, value)
            length = response.getheader("Content-Length")
            self.send_header("Content-Length", length if self.command == "HEAD" and length else str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            upstream.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    return Handler


@pytest.fixture
def flaky_s3(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> Iterator[FlakyProxy]:
    """A bucket reached through a FlakyProxy (share 0.2, seed 0: set `share` to change it; 0 makes
    it pass everything); AWS_ENDPOINT_URL is the proxy's. Its `url` is "s3://<bucket>"."""
    bucket = make_bucket(moto_endpoint)
    proxy = FlakyProxy(target=moto_endpoint.split("://", 1)[1])
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(proxy))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    proxy.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    proxy.url = f"s3://{bucket}"
    set_s3_env(monkeypatch, proxy.endpoint, tmp_path)
    _private_cache(monkeypatch, tmp_path)
    yield proxy
    server.shutdown()
    server.server_close()
    _clear_clients()
