"""Paths that may be object-store URLs: one filesystem per URL, retries, checks and commits.

Wherever forja takes a path (`data.path`, `forja prepare --out`, `run.dir`, `forja export`)
it may also take an fsspec URL: `s3://bucket/dir`, `gs://...`, `memory://...`. Plain paths
and `file://` URLs are local and keep going through `forja.files`.

    is_url("s3://b/x")                       True; "/data", "file:///data", "jsonl:a.jsonl": False
    fs, path = filesystem("s3://b/x")        an fsspec filesystem and the path inside it
    retrying(lambda: fs.cat_file(path), what="reading s3://b/x")
    check_reachable("s3://b/x", write=True)  one sentence for a missing bucket, no credentials,
                                             an endpoint that does not answer
    write_bytes_atomic("s3://b/x/a.json", data)
    upload_dir(local, "s3://b/x", last=("meta.json",))   the marker object written last

S3 endpoints come from the standard `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`, credentials
and region from boto's usual chain, and anything else from fsspec's own configuration
(`FSSPEC_S3_*` variables, ~/.config/fsspec), which fsspec merges in when the filesystem is built.

Retries happen in one layer: forja's `retrying` (exponential backoff with jitter on connection
errors, timeouts, 5xx and throttling; FORJA_STORAGE_ATTEMPTS attempts, default 6). The
filesystems handed out here have botocore's and s3fs's own retries turned down to one attempt,
so a request that fails is seen by forja and retried with its backoff, not retried 5 x 5 times
below it. Where one call is many requests that forja cannot wrap one by one (DCP's fsspec
storage, a streamed corpus file, a multipart upload), the filesystem is asked for with
`inner_attempts` (or `storage_options(url, inner_attempts=ATTEMPTS)`), so that botocore retries
each of those requests itself. fsspec's own `config_kwargs` for s3 (timeouts, retries) win.

Stores without an atomic rename (S3, GCS) still write one object atomically: a PUT is seen
whole or not at all. A directory of objects is committed by writing a small marker object last
(for prepared data, meta.json); readers trust a directory only once its marker exists.

Imports of fsspec and s3fs are lazy: training on local paths never loads them (torch's DCP
imports fsspec itself when it is installed; s3fs and boto never load).
"""

from __future__ import annotations

import errno
import os
import random
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from forja.errors import ForjaError

T = TypeVar("T")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# Stores whose single-object write is atomic (seen whole or not at all) and which have no
# atomic rename: a write goes straight to its name, never through a temporary one.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "memory"})
_S3 = frozenset({"s3", "s3a"})
_THROTTLING = frozenset({"Throttling", "ThrottlingException", "SlowDown", "RequestTimeout",
                         "RequestTimeoutException", "InternalError", "ServiceUnavailable",
                         "TooManyRequests", "RequestLimitExceeded", "BandwidthLimitExceeded"})
# (s3fs turns an HTTP status into an OSError raised from botocore's ClientError, whose response
# is checked below; these are the errnos of the network itself.)
_TRANSIENT_ERRNOS = frozenset({errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED,
                               errno.EPIPE, errno.EAGAIN})
# Exception class names (from aiohttp, botocore, urllib3, fsspec) that mean the request may
# succeed when sent again; matched by name so none of those libraries need be imported here.
_TRANSIENT_NAMES = frozenset({
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ConnectionError", "HTTPClientError", "ResponseStreamingError", "IncompleteReadError",
    "ServerDisconnectedError", "ClientConnectionError", "ClientConnectorError", "ClientOSError",
    "ClientPayloadError", "ServerTimeoutError", "FSTimeoutError", "ProtocolError",
    "IncompleteRead", "ResponseParserError", "ContentLengthError", "TransferEncodingError",
})

ATTEMPTS = 6  # FORJA_STORAGE_ATTEMPTS overrides it (read at each call)
BACKOFF_S = 0.1  # the first wait, doubled after each failure; FORJA_STORAGE_BACKOFF_S overrides it
MAX_BACKOFF_S = 10.0

_cache: dict[tuple, Any] = {}
_cache_lock = threading.Lock()


def is_url(path: Any) -> bool:
    """Whether `path` names an fsspec store (`s3://`, `gs://`, `memory://`, `https://` ...);
    plain paths and `file://` URLs are local."""
    match = _SCHEME.match(str(path)) if isinstance(path, (str, os.PathLike)) else None
    return bool(match) and match.group(1).lower() != "file"


def local_path(path: str | os.PathLike[str]) -> Path:
    """A local path given plainly or as a `file://` URL, as a Path (`~` expanded)."""
    text = os.fspath(path)
    if text.lower().startswith("file://"):
        text = text[len("file://"):]
    return Path(text).expanduser()


def protocol(url: str) -> str:
    """The scheme of `url`, lower case ("s3"); "file" for a local path."""
    match = _SCHEME.match(str(url))
    return match.group(1).lower() if match else "file"


def join(base: str | os.PathLike[str], *parts: str) -> str:
    """`base` with `parts` appended by "/", for a URL or a local path alike (returned as str)."""
    if not is_url(base):
        return str(local_path(base).joinpath(*parts))
    out = str(base).rstrip("/")
    for part in parts:
        out += "/" + part.strip("/")
    return out


def endpoint(url: str) -> str:
    """The endpoint a URL's requests go to, for messages."""
    if protocol(url) in _S3:
        found = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return found or "the default AWS S3 endpoint"
    return f"the {protocol(url)}:// store"


def storage_options(url: str, *, inner_attempts: int = 1) -> dict[str, Any]:
    """The keyword arguments forja builds `url`'s filesystem with (fsspec's configuration is
    merged in below them by fsspec itself). `inner_attempts`: how many times the client library
    sends one request (1: forja's `retrying` is the only retry layer)."""
    if protocol(url) not in _S3:
        return {}
    config = {"retries": {"total_max_attempts": inner_attempts, "mode": "standard"},
              "connect_timeout": 5, "read_timeout": 30}
    try:  # fsspec merges its configuration's keys under these, but not inside config_kwargs: here
        from fsspec.config import conf

        config.update(conf.get("s3", {}).get("config_kwargs") or {})
    except ImportError:
        pass
    options: dict[str, Any] = {
        "skip_instance_cache": True,  # forja caches by options and environment below, not s3fs
        "config_kwargs": config,
    }
    found = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if found:
        options["endpoint_url"] = found
    return options


def filesystem(url: str, *, inner_attempts: int = 1) -> tuple[Any, str]:
    """The fsspec filesystem holding `url` and the path within it. One instance per protocol,
    options and credential environment, so a changed AWS_* variable gets a new client."""
    try:
        from fsspec.core import url_to_fs  # lazy: local training never imports fsspec
    except ImportError:
        raise ForjaError(f"{url} needs fsspec, which is not installed; pip install 'forja[s3]' "
                         "(or fsspec and the package of that store)") from None
    if not is_url(url):
        url = str(local_path(url))
    options = storage_options(url, inner_attempts=inner_attempts)
    env = tuple(os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
                                             "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                                             "AWS_DEFAULT_REGION", "AWS_REGION"))
    key = (protocol(url), repr(sorted(options.items())), env, os.getpid())
    with _cache_lock:
        fs = _cache.get(key)
    if fs is None:
        try:
            fs, _ = url_to_fs(url, **options)
        except ImportError as exc:  # fsspec knows the protocol but its package is missing
            fix = "pip install 'forja[s3]'" if protocol(url) in _S3 else "install that package"
            raise ForjaError(f"{url} needs a package that is not installed ({exc}); {fix} and run again") from None
        if protocol(url) in _S3:
            fs.retries = 1  # s3fs's own retry loop (a class attribute): botocore's is the inner one
        with _cache_lock:
            _cache[key] = fs
    return fs, fs._strip_protocol(url)


def clear_cache() -> None:
    """Forget every filesystem built so far (tests: a new server, new credentials)."""
    with _cache_lock:
        _cache.clear()


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is worth sending the request again:
    a connection error, a timeout, an HTTP 5xx or 429, or a throttling answer."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__name__ in _TRANSIENT_NAMES:
            return True
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status >= 500 or status == 429 or response.get("Error", {}).get("Code") in _THROTTLING:
                return True
        status = getattr(exc, "status", None) or getattr(exc, "code", None)
        if isinstance(status, int) and (status >= 500 or status == 429):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retrying(fn: Callable[[], T], *, what: str, attempts: int | None = None, url: str | None = None) -> T:
    """`fn()`, sent again after a transient error with exponential backoff and full jitter;
    after `attempts` (FORJA_STORAGE_ATTEMPTS, default 6) one ForjaError naming `what`.
    A missing object, a refused permission or any other lasting error is raised at once, unchanged
    (missing credentials as the ForjaError of `credentials_error`)."""
    attempts = attempts or int(env_number("FORJA_STORAGE_ATTEMPTS", ATTEMPTS, least=1))
    backoff = env_number("FORJA_STORAGE_BACKOFF_S", BACKOFF_S, least=0)
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 -- sorted below into transient or not
            if _no_credentials(exc):
                raise credentials_error(url or what) from exc
            if not is_transient(exc):
                raise
            if attempt == attempts:
                where = f" at {endpoint(url)}" if url else ""
                raise ForjaError(f"{what} failed {attempts} times{where} ({_brief(exc)}); the store is "
                                 f"unreachable or overloaded: check the endpoint and network, or raise "
                                 f"FORJA_STORAGE_ATTEMPTS, and run again") from exc
            time.sleep(random.uniform(0, min(MAX_BACKOFF_S, backoff * 2 ** (attempt - 1))))
    raise AssertionError("unreachable")


def env_number(name: str, default: float, *, least: float) -> float:
    """The number in environment variable `name` (unset or empty: `default`), at least `least`."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= least:
        raise ForjaError(f"{name}={text} is not a number of at least {least:g}; set it to one or unset it")
    return value


def _brief(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _no_credentials(exc: BaseException) -> bool:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def credentials_error(url: str) -> ForjaError:
    """The one sentence for a store that needs credentials none were found for."""
    return ForjaError(f"no credentials for {url}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                      f"(or AWS_PROFILE, or run where an instance role provides them) and run again")


def bucket_of(url: str) -> str:
    """The bucket (first path component) of an object-store URL."""
    return str(url).split("://", 1)[1].split("/", 1)[0]


def check_reachable(url: str, *, write: bool, what: str = "") -> None:
    """Stop with one sentence, before any work, unless `url`'s store answers, its bucket exists,
    credentials are found and (with `write`) an object can be written there. Local paths: no-op
    (forja.files.check_writable covers them). Each request gets `retrying`'s full attempts: a
    launch checks its store several times, and a store that fails a share of its requests must
    not fail the preflight that a run through it would survive."""
    if not is_url(url):
        return
    label = f"{what} {url}".strip()
    fs, path = filesystem(url)
    bucket = bucket_of(url)
    try:
        # The URL's own prefix, not the bucket's root: credentials may be allowed to list only
        # below a prefix. An empty prefix is fine here (a missing object is the caller's to name).
        retrying(lambda: fs.ls(path, detail=False, refresh=True), what=f"reaching {label}", url=url)
    except FileNotFoundError as exc:
        if _missing_bucket(exc):
            raise ForjaError(f"bucket {bucket} of {label} does not exist at {endpoint(url)}; create it "
                             f"or fix the URL") from None
    except ForjaError as exc:
        if exc.__cause__ is not None and is_transient(exc.__cause__):
            raise ForjaError(f"{label} cannot be reached: {endpoint(url)} does not answer "
                             f"({type(exc.__cause__).__name__}); check AWS_ENDPOINT_URL and the network") from None
        raise
    except PermissionError as exc:
        raise ForjaError(f"access to {label} is denied ({_brief(exc)}); use credentials allowed to "
                         f"{'write' if write else 'read'} bucket {bucket}") from None
    if write:
        probe = join(url, f".forja-write-test-{uuid.uuid4().hex[:12]}")
        _, probe_path = filesystem(probe)
        try:
            retrying(lambda: fs.pipe_file(probe_path, b""), what=f"writing to {label}", url=url)
            retrying(lambda: fs.rm_file(probe_path), what=f"cleaning up {probe}", url=url)
        except PermissionError as exc:
            raise ForjaError(f"{label} cannot be written ({_brief(exc)}); use credentials allowed to "
                             f"write bucket {bucket}, or choose another location") from None


def _missing_bucket(exc: BaseException) -> bool:
    """Whether a FileNotFoundError says the bucket itself is missing (not only an object)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        response = getattr(exc, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") == "NoSuchBucket":
            return True
        if "bucket does not exist" in str(exc).lower() or "nosuchbucket" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def exists(url: str) -> bool:
    """Whether the object or directory `url` (or a local path) exists, asked afresh."""
    if not is_url(url):
        return local_path(url).exists()
    fs, path = filesystem(url)
    fs.invalidate_cache(path)
    return retrying(lambda: fs.exists(path), what=f"looking up {url}", url=url)


def size(url: str) -> int:
    """The size in bytes of object `url`; FileNotFoundError when there is none."""
    if not is_url(url):
        return local_path(url).stat().st_size
    fs, path = filesystem(url)
    return int(retrying(lambda: fs.size(path), what=f"looking up {url}", url=url))


def read_bytes(url: str, start: int | None = None, end: int | None = None) -> bytes:
    """The bytes of `url` (local or remote), or its range [start, end), with retries."""
    if not is_url(url):
        with open(local_path(url), "rb") as f:
            f.seek(start or 0)
            return f.read() if end is None else f.read(end - (start or 0))
    fs, path = filesystem(url)
    return retrying(lambda: fs.cat_file(path, start=start, end=end), what=f"reading {url}", url=url)


def write_bytes_atomic(url: str, data: bytes | str) -> None:
    """Write object `url` whole or not at all. On an object store one PUT is atomic; on a
    filesystem-like store the data goes to a temporary name first and is moved into place."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if not is_url(url):
        from forja.files import write_atomic

        write_atomic(local_path(url), raw)
        return
    fs, path = filesystem(url)
    if protocol(url) in _OBJECT_STORES:
        retrying(lambda: fs.pipe_file(path, raw), what=f"writing {url}", url=url)
        return
    parent, name = path.rsplit("/", 1) if "/" in path else ("", path)
    tmp = f"{parent}/.{name}.tmp-{uuid.uuid4().hex[:8]}" if parent else f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    retrying(lambda: fs.pipe_file(tmp, raw), what=f"writing {url}", url=url)
    retrying(lambda: fs.mv(tmp, path), what=f"moving {url} into place", url=url)


def upload_dir(local: str | os.PathLike[str], url: str, *, last: Iterable[str] = ()) -> list[str]:
    """Copy every file under the local directory `local` to `url`, each with retries; the files
    named in `last` (relative, e.g. "meta.json", the commit marker) are written after all others,
    so a reader that trusts the directory once its marker exists never sees half of it.
    Returns the relative names uploaded, in order."""
    local = local_path(local)
    last = [str(name) for name in last]
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    order = [n for n in names if n not in last] + [n for n in last if n in names]
    # A large file goes up in parts (multipart upload): botocore retries each part itself, so
    # one failed part does not send the whole file again; forja's retry still wraps the file.
    fs, _ = filesystem(url, inner_attempts=3)
    for name in order:
        target = join(url, name)
        _, path = filesystem(target)
        retrying(lambda: fs.put_file(str(local / name), path), what=f"uploading {target}", url=url)
    return order


MARKER = "COMMITTED"


def commit(url: str, marker: str = MARKER, data: bytes | str = b"") -> None:
    """Mark the directory `url` complete by writing its marker object, after every other object."""
    write_bytes_atomic(join(url, marker), data)


def committed(url: str, marker: str = MARKER) -> bool:
    """Whether the directory `url` is complete: its marker object exists."""
    return exists(join(url, marker))


def remove_tree(url: str) -> None:
    """Delete everything under `url` (with retries); nothing there is fine."""
    if not is_url(url):
        import shutil

        shutil.rmtree(local_path(url), ignore_errors=True)
        return
    fs, path = filesystem(url)
    try:
        retrying(lambda: fs.rm(path, recursive=True), what=f"deleting {url}", url=url)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(path)
