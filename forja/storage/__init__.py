"""Object storage: fsspec URLs (`s3://`, `gs://`, ...) wherever forja takes a path.

`fs` holds the filesystem, retry, check and commit helpers (no torch, fsspec imported lazily);
`blocks` the bounded local block cache through which prepared shards are read by ranges;
`paths` StoredPath, a corpus object in place of a local Path for the data sources.
"""

from forja.storage.fs import (
    ATTEMPTS,
    MARKER,
    check_reachable,
    clear_cache,
    commit,
    committed,
    credentials_error,
    endpoint,
    exists,
    filesystem,
    is_transient,
    is_url,
    join,
    local_path,
    protocol,
    read_bytes,
    remove_tree,
    retrying,
    size,
    storage_options,
    upload_dir,
    write_bytes_atomic,
)

__all__ = [
    "ATTEMPTS", "MARKER", "check_reachable", "clear_cache", "commit", "committed", "credentials_error",
    "endpoint", "exists", "filesystem", "is_transient", "is_url", "join", "local_path", "protocol",
    "read_bytes", "remove_tree", "retrying", "size", "storage_options", "upload_dir", "write_bytes_atomic",
]
