"""Where checkpoint files live: a small interface with a local-filesystem and an S3 implementation.

A checkpoint is written under a *staging* prefix and made visible by ``publish``. On a filesystem
staging is a ``.partial`` directory renamed into place (atomic on POSIX); on an object store, where
there is no rename, staging is the final prefix itself and the checkpoint's ``index.json``, written
last, is what makes it complete (a PUT is atomic). Readers only trust checkpoints with an index.
Keys are ``/``-separated paths relative to the storage root.
"""

from __future__ import annotations

import io
import os
import shutil
import uuid
from pathlib import Path
from typing import BinaryIO, Protocol, runtime_checkable


class StorageError(RuntimeError):
    """A storage operation failed; the message names the key and the backend."""


@runtime_checkable
class Storage(Protocol):
    """What the checkpointer needs from a backend. Implementations must be picklable (the
    background writer process receives one). Optionally ``open_read(key)``: the object as a binary
    file with ``readinto`` and ``seek`` (``FileNotFoundError`` when absent), through which shards
    are streamed, read once and verified on the way; without it the reader uses ``get``."""

    def put(self, key: str, chunks: list[memoryview | bytes]) -> None:
        """Write the concatenation of ``chunks`` to ``key``, durably (fsync'ed) when it returns."""

    def get(self, key: str) -> bytes:
        """The whole object; ``FileNotFoundError`` naming the key when absent."""
    def exists(self, key: str) -> bool: ...

    def list_dir(self, prefix: str) -> list[str]:
        """Names (not full keys) directly under ``prefix``: files and sub-prefixes."""

    def delete_tree(self, prefix: str) -> None:
        """Remove everything under ``prefix`` (no error when absent)."""

    def staging_prefix(self, final_prefix: str) -> str:
        """Where a checkpoint destined for ``final_prefix`` is written before ``publish``."""

    def publish(self, staging: str, final_prefix: str) -> None:
        """Make a fully written checkpoint visible under ``final_prefix`` (replacing an old one)."""

    def describe(self) -> str:
        """A URI-like name for messages and the manifest."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A directory on the local filesystem; writes go to a temporary name, are fsync'ed, then renamed."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key

    def put(self, key: str, chunks: list[memoryview | bytes]) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes:
        path = self._path(key)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such checkpoint file")
        return path.read_bytes()

    def open_read(self, key: str) -> BinaryIO:
        path = self._path(key)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such checkpoint file")
        return open(path, "rb", buffering=0)  # unbuffered: readinto lands straight in the caller's memory

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def list_dir(self, prefix: str) -> list[str]:
        path = self._path(prefix)
        return sorted(p.name for p in path.iterdir()) if path.is_dir() else []

    def delete_tree(self, prefix: str) -> None:
        path = self._path(prefix)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()

    def staging_prefix(self, final_prefix: str) -> str:
        return final_prefix + ".partial"

    def publish(self, staging: str, final_prefix: str) -> None:
        src, dst = self._path(staging), self._path(final_prefix)
        trash = None
        if dst.exists():  # a checkpoint of this step left by an earlier attempt: replace it
            trash = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(dst, trash)
        os.replace(src, dst)
        _fsync_dir(dst.parent)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def describe(self) -> str:
        return str(self.root)


class S3Storage:
    """An S3-compatible bucket (AWS, MinIO, moto) through boto3; credentials come from the
    usual AWS environment variables or config files."""

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url or None
        self.region = region or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self._client = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_client": None}  # clients are not picklable; rebuilt lazily

    @property
    def client(self):
        if self._client is None:
            try:
                import boto3
            except ImportError:
                raise StorageError("checkpoint.storage: s3:// needs boto3 (pip install 'lockstep[s3]')") from None
            self._client = boto3.client("s3", endpoint_url=self.endpoint_url, region_name=self.region)
        return self._client

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, chunks: list[memoryview | bytes]) -> None:
        body = b"".join(bytes(c) if isinstance(c, memoryview) else c for c in chunks)
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body)
        except Exception as err:  # botocore raises many kinds; name the object
            raise StorageError(f"{self.describe()}/{key}: upload failed: {err}") from err

    def get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            raise FileNotFoundError(f"{self.describe()}/{key}: no such checkpoint object") from None

    def open_read(self, key: str) -> BinaryIO:
        return io.BytesIO(self.get(key))

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return self.list_dir(key) != []
            raise

    def list_dir(self, prefix: str) -> list[str]:
        base = self._key(prefix).rstrip("/") + "/" if prefix else (self.prefix + "/" if self.prefix else "")
        names: set[str] = set()
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base,
                                                                           Delimiter="/"):
            names.update(o["Key"][len(base):] for o in page.get("Contents", []))
            names.update(p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", []))
        return sorted(n for n in names if n)

    def delete_tree(self, prefix: str) -> None:
        base = self._key(prefix).rstrip("/") + "/"
        keys = [o["Key"] for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                                          Prefix=base)
                for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket,
                                       Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})

    def staging_prefix(self, final_prefix: str) -> str:
        return final_prefix  # no rename on S3: the index, written last, marks completion

    def publish(self, staging: str, final_prefix: str) -> None:
        if staging != final_prefix:
            raise StorageError(f"{self.describe()}: S3 checkpoints are written in place")

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


def storage_from_uri(uri: str, *, endpoint_url: str = "") -> Storage:
    """``s3://bucket/prefix`` -> S3Storage; anything else is a local directory."""
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"checkpoint.storage: {uri!r} names no bucket (s3://BUCKET/PREFIX)")
        return S3Storage(bucket, prefix, endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL"))
    if "://" in uri:
        raise ValueError(f"checkpoint.storage: unsupported scheme in {uri!r} (a directory or s3://...)")
    return LocalStorage(uri)
