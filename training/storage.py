"""One small object-store interface over a local directory or ``gs://bucket/prefix``.

The run root (see docs/architecture.md) is written by several processes and read by
others (sensors, the CLI, Airflow retries on another machine).  GCS has no
atomic rename and no append, so everything here is expressed in terms a bucket
can honour on its own:

* ``put``         replaces a whole object (a single-object upload is atomic);
* ``create``      writes an object only if it does not exist yet (write-once);
* ``get`` / ``list`` / ``delete``.

The local implementation gives the same guarantees with ``O_EXCL`` and
``rename``.  Append-style logs (events) are built from write-once objects with
sortable names, never by appending.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from training.store_calls import before_call, disturb_calls


class AlreadyExists(Exception):
    """A write-once object is already there."""


class NotFound(Exception):
    """The object does not exist."""


class RootGone(FileNotFoundError):
    """A store's root, there before, is gone (a directory renamed, deleted or unmounted; a bucket deleted): a lasting failure."""

    def __init__(self, root: Path | str, why: str = "No such file or directory") -> None:
        super().__init__(errno.ENOENT, f"the run root {root} is gone ({why})", str(root))


class Store(Protocol):
    @property
    def uri(self) -> str: ...

    def put(self, key: str, data: bytes) -> None: ...
    def create(self, key: str, data: bytes) -> None: ...
    def create_in(self, reserve: str, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def get_range(self, key: str, start: int, size: int) -> bytes: ...
    def put_parts(self, key: str, parts: Iterable[memoryview]) -> None: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str = "") -> builtins.list[str]: ...
    def delete(self, key: str) -> None: ...
    def move(self, src: str, dst: str) -> None: ...
    def child(self, key: str) -> str: ...
    def checksums(self, prefix: str = "") -> dict[str, builtins.list[int]]: ...
    def usage(self, prefix: str) -> tuple[int, float | None]: ...


def is_gcs(uri: str) -> bool:
    return uri.startswith("gs://")


@dataclass(frozen=True)
class Scheme:
    """What the code around a store may assume of its kind of storage: the differences, stated once here."""

    name: str
    filesystem: bool  # a local directory tree: paths expand and glob, directories are made, the disk can fill
    requests: bool  # every look is a network request: beats, leases and polls are paced for it
    atomic_rename: bool  # renaming a directory commits it (else a commit marker object does)
    cached_listings: bool  # the file-system layer above it caches listings per process: flush before judging


class StorageScheme:
    """A kind of storage a URI names: which URIs are its own, what may be assumed of it, how a store of it opens.

    A new scheme is one subclass registered with ``@storage_scheme`` (plus its test); ``scheme`` and
    ``open_store`` choose among them by the URI's prefix (a URI no scheme claims is a local path)."""

    name: ClassVar[str]
    prefix: ClassVar[str]  # "gs://"; "" for the local file system, the scheme of every URI no other claims

    def traits(self, uri: str) -> Scheme:
        raise NotImplementedError

    def open(self, uri: str) -> Store:
        raise NotImplementedError

    def unreachable(self, op: str, key: str) -> Exception:
        """The error a call of this kind raises when its storage cannot be reached (chaos: ``disturb``)."""
        return OSError(errno.ETIMEDOUT, f"the run root is unreachable (chaos), {op} {key}")


# Every storage scheme by name (``@storage_scheme`` adds one).
SCHEMES: dict[str, StorageScheme] = {}
_S = TypeVar("_S", bound=type[StorageScheme])  # (a type parameter list needs Python 3.12)


def storage_scheme(cls: _S) -> _S:
    """Register a storage scheme (a class decorator)."""
    if cls.name in SCHEMES:
        raise ValueError(f"storage scheme {cls.name!r} is registered twice")
    SCHEMES[cls.name] = cls()
    return cls


def scheme_of(uri: str) -> StorageScheme:
    """The registered scheme whose prefix ``uri`` starts with (the longest), else the local file system's."""
    claimed = [s for s in SCHEMES.values() if s.prefix and uri.startswith(s.prefix)]
    return max(claimed, key=lambda s: len(s.prefix)) if claimed else SCHEMES["file"]


def scheme(uri: str) -> Scheme:
    """The scheme of a run root, dataset or checkpoint URI (``gs://`` or a local path): what may be assumed of it."""
    return scheme_of(uri).traits(uri)


# Buckets mounted on this host (GCS FUSE on GKE): ``bucket=/path[,bucket=/path...]``, set by the pod spec.
GCS_MOUNTS_ENV = "RTRAIN_GCS_MOUNTS"


def mounted_path(uri: str) -> str | None:
    """The local path of a ``gs://`` URI when its bucket is mounted here (``RTRAIN_GCS_MOUNTS``), else None."""
    if not is_gcs(uri):
        return None
    bucket, _, key = uri[len("gs://") :].partition("/")
    for item in filter(None, os.environ.get(GCS_MOUNTS_ENV, "").split(",")):
        name, sep, path = item.partition("=")
        if sep and name == bucket and path:
            return os.path.join(path, key) if key else path
    return None


def join(uri: str, *parts: str) -> str:
    out = uri.rstrip("/")
    for p in parts:
        out = out + "/" + p.strip("/")
    return out


IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers one writev takes


def write_parts(path: str | Path, parts: Iterable[Any], *, sync: bool) -> None:
    """Write a file from its parts (buffers) with as few system calls as the kernel allows; fsync if ``sync``."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        i = 0
        while i < len(views):
            n = os.writev(fd, views[i : i + IOV_MAX])
            while i < len(views) and n >= views[i].nbytes:  # the buffers written whole
                n -= views[i].nbytes
                i += 1
            if n:  # a short write ended inside this buffer
                views[i] = views[i][n:]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


# Local roots this process works in, made before it started (a job's run root), by their (device, inode).
_EXPECTED_ROOTS: dict[Path, tuple[int, int]] = {}


def expect_root(uri: str) -> None:
    """This process works inside the existing local root ``uri`` (its job's run root): a write under it once it has
    vanished (renamed, deleted, its volume unmounted) raises RootGone, where it would make it anew or write on
    whatever directory is in its place now."""
    if scheme(uri).filesystem:
        root = Path(uri).expanduser().resolve()
        with contextlib.suppress(OSError):  # not there yet: nothing to expect
            st = os.stat(root)
            _EXPECTED_ROOTS[root] = (st.st_dev, st.st_ino)


def check_root(uri: str) -> None:
    """RootGone when the local root ``uri`` this process expects (``expect_root``) has vanished."""
    if scheme(uri).filesystem:
        _check_expected(Path(uri).expanduser().resolve())


def _check_expected(root: Path) -> None:
    """RootGone when the expected root at or above ``root`` is gone, or another directory is in its place."""
    for path in (root, *root.parents):
        ident = _EXPECTED_ROOTS.get(path)
        if ident is None:
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise RootGone(path) from None
        if (st.st_dev, st.st_ino) != ident:
            raise RootGone(path, "another directory is in its place: unmounted, or moved")
        return


@dataclass
class LocalStore:
    """A directory on a local (or mounted) file system."""

    root: Path

    @property
    def uri(self) -> str:
        return str(self.root)

    def _make_parent(self, path: Path) -> None:
        """Make ``path``'s directory, but write nothing under a root this process expects (``expect_root``) that
        has vanished: it is not made anew, nor is the directory now in its place written on (RootGone)."""
        _check_expected(self.root)
        path.parent.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if ".." in Path(key).parts:
            raise ValueError(f"invalid object key {key!r}")
        return self.root / key

    def child(self, key: str) -> str:
        return str(self._path(key))

    def put(self, key: str, data: bytes) -> None:
        before_call("put", key, self.uri)
        path = self._path(key)
        self._make_parent(path)
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        except OSError as e:
            if e.errno == errno.ENOSPC and path.exists():
                return self._overwrite(path, data)
            raise
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC and path.exists():
                return self._overwrite(path, data)
            raise

    def put_parts(self, key: str, parts: Iterable[memoryview]) -> None:
        """Write an object from its parts, one after another, without joining them in memory (then fsync)."""
        before_call("put", key, self.uri)
        path = self._path(key)
        self._make_parent(path)
        write_parts(path, parts, sync=True)

    @staticmethod
    def _overwrite(path: Path, data: bytes) -> None:
        """A full disk: replace a small object in place (not atomic: readers retry a torn read).

        Status documents and heartbeats are rewritten whole by one writer; in place they
        need no new blocks, so the final state of a job can still be recorded.
        """
        with open(path, "r+b") as f:
            f.truncate(0)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def create_in(self, reserve: str, key: str, data: bytes) -> None:
        """Create ``key`` in the blocks of the object ``reserve`` (a full disk's last words): no new space needed.

        ``data`` is written over the start of the reserve, which is cut to its size and
        renamed to ``key``; the reserve is gone after.
        """
        before_call("create_in", key, self.uri)
        src, path = self._path(reserve), self._path(key)
        self._make_parent(path)
        if path.exists():  # keys written this way are unique (a time stamp and a nonce): a plain check will do
            raise AlreadyExists(str(path))
        with open(src, "r+b") as f:
            f.write(data)
            f.truncate(len(data))
            f.flush()
            os.fsync(f.fileno())
        os.rename(src, path)  # a rename takes no new inode (a link can need one, and space for it, on tmpfs)

    def create(self, key: str, data: bytes) -> None:
        before_call("create", key, self.uri)
        # Write to a temporary name, then hard-link: link(2) fails when the
        # target exists, so a reader never sees a half-written object and two
        # writers never both win.
        path = self._path(key)
        self._make_parent(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except OSError as e:
                if e.errno == errno.EEXIST:
                    raise AlreadyExists(str(path)) from None
                raise
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def get(self, key: str) -> bytes:
        before_call("get", key, self.uri)
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(str(self._path(key))) from None

    def get_range(self, key: str, start: int, size: int) -> bytes:
        """``size`` bytes of an object from ``start``."""
        before_call("get_range", key, self.uri)
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(size)
        except FileNotFoundError:
            raise NotFound(str(self._path(key))) from None

    def exists(self, key: str) -> bool:
        before_call("exists", key, self.uri)
        return self._path(key).exists()

    def list(self, prefix: str = "") -> builtins.list[str]:
        before_call("list", prefix, self.uri)
        base = self._path(prefix) if prefix else self.root
        # A prefix may name a directory ("a/") or the start of a file name ("a/x").
        if base.is_dir():
            walk_root = base
        elif not prefix or prefix.endswith("/"):  # no such directory (a root that is gone lists nothing)
            return []
        else:
            walk_root = base.parent
        if not walk_root.exists():
            return []
        keys = []
        for dirpath, _dirs, files in os.walk(walk_root):
            for name in files:
                if name.startswith("."):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), self.root)
                if rel.startswith(prefix):
                    keys.append(rel)
        return sorted(keys)

    def checksums(self, prefix: str = "") -> dict[str, builtins.list[int]]:
        """``{key relative to prefix: [size, crc32c]}`` of the objects under ``prefix``."""
        before_call("checksums", prefix, self.uri)
        import google_crc32c

        out = {}
        strip = len(prefix.rstrip("/")) + 1 if prefix else 0
        for key in self.list(prefix.rstrip("/") + "/" if prefix else ""):
            crc = google_crc32c.Checksum()
            size = 0
            with open(self._path(key), "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    crc.update(block)
                    size += len(block)
            out[key[strip:]] = [size, int.from_bytes(crc.digest(), "big")]
        return out

    def usage(self, prefix: str) -> tuple[int, float | None]:
        """(bytes, newest write time) of everything under ``prefix``; (0, None) when there is nothing."""
        before_call("usage", prefix, self.uri)
        total, newest = 0, None
        for dirpath, _dirs, files in os.walk(self._path(prefix.rstrip("/"))):
            mtimes = [os.stat(dirpath).st_mtime]
            for name in files:
                st = os.stat(os.path.join(dirpath, name))
                total += st.st_size
                mtimes.append(st.st_mtime)
            newest = max([*mtimes, newest] if newest is not None else mtimes)
        return total, newest

    def move(self, src: str, dst: str) -> None:
        """Move an object or a whole prefix (a rename on one file system)."""
        before_call("move", src, self.uri)
        target = self._path(dst)
        self._make_parent(target)
        os.rename(self._path(src), target)

    def delete(self, key: str) -> None:
        before_call("delete", key, self.uri)
        path = self._path(key)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                path.unlink()
            except FileNotFoundError:
                pass


class GCSStore:
    """``gs://bucket/prefix`` through google-cloud-storage.

    Transient errors (429, 5xx, connection resets, timeouts) are retried with
    exponential backoff by the client's own retry policy; conditional writes
    (``if_generation_match=0``) make the retries of ``create`` safe.
    """

    def __init__(self, uri: str, client: object | None = None) -> None:

        assert uri.startswith("gs://")
        rest = uri[len("gs://") :]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {uri!r}")
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        self.client = client or gcs_client()
        self.bucket = self.client.bucket(bucket)  # type: ignore[attr-defined]

    @property
    def uri(self) -> str:
        return "gs://" + self.bucket_name + ("/" + self.prefix if self.prefix else "")

    def _name(self, key: str) -> str:
        if ".." in key.split("/"):
            raise ValueError(f"invalid object key {key!r}")
        return f"{self.prefix}/{key}" if self.prefix else key

    def child(self, key: str) -> str:
        return "gs://" + self.bucket_name + "/" + self._name(key)

    @contextlib.contextmanager
    def _bucket_there(self) -> Iterator[None]:
        """RootGone for a write or listing answered "not found": only a bucket that is gone answers them so."""
        from google.api_core import exceptions
        from google.cloud.storage.exceptions import InvalidResponse  # a resumable upload's

        try:
            yield
        except (exceptions.NotFound, InvalidResponse) as e:
            if isinstance(e, InvalidResponse) and getattr(e.response, "status_code", None) != 404:
                raise
            raise RootGone(self.uri, f"bucket {self.bucket_name} not found") from None

    def put(self, key: str, data: bytes) -> None:
        before_call("put", key, self.uri)
        from google.cloud.storage.retry import DEFAULT_RETRY

        with self._bucket_there():
            self.bucket.blob(self._name(key)).upload_from_string(data, retry=DEFAULT_RETRY)

    def put_parts(self, key: str, parts: Iterable[memoryview]) -> None:
        """Upload an object from its parts as a stream (a resumable upload), without joining them in memory."""
        before_call("put", key, self.uri)
        from google.cloud.storage.retry import DEFAULT_RETRY

        with self._bucket_there(), self.bucket.blob(self._name(key)).open("wb", retry=DEFAULT_RETRY) as f:
            for part in parts:
                f.write(part)

    def create(self, key: str, data: bytes) -> None:
        before_call("create", key, self.uri)
        from google.api_core import exceptions
        from google.cloud.storage.retry import DEFAULT_RETRY

        blob = self.bucket.blob(self._name(key))
        # GCS enforces the precondition (so does the tests' emulator, patched); a look first spares a doomed upload.
        if blob.exists(retry=DEFAULT_RETRY):
            raise AlreadyExists(self.child(key))
        try:
            with self._bucket_there():
                blob.upload_from_string(data, if_generation_match=0, retry=DEFAULT_RETRY)
        except exceptions.PreconditionFailed:
            raise AlreadyExists(self.child(key)) from None

    def get(self, key: str) -> bytes:
        before_call("get", key, self.uri)
        from google.api_core import exceptions
        from google.cloud.storage.retry import DEFAULT_RETRY

        try:
            return bytes(self.bucket.blob(self._name(key)).download_as_bytes(retry=DEFAULT_RETRY))
        except exceptions.NotFound:
            raise NotFound(self.child(key)) from None

    def get_range(self, key: str, start: int, size: int) -> bytes:
        """``size`` bytes of an object from ``start`` (one ranged GET)."""
        before_call("get_range", key, self.uri)
        from google.api_core import exceptions
        from google.cloud.storage.retry import DEFAULT_RETRY

        if size <= 0:
            return b""
        blob = self.bucket.blob(self._name(key))
        try:
            return bytes(blob.download_as_bytes(start=start, end=start + size - 1, retry=DEFAULT_RETRY))
        except exceptions.NotFound:
            raise NotFound(self.child(key)) from None

    def exists(self, key: str) -> bool:
        before_call("exists", key, self.uri)
        from google.cloud.storage.retry import DEFAULT_RETRY

        return bool(self.bucket.blob(self._name(key)).exists(retry=DEFAULT_RETRY))

    def list(self, prefix: str = "") -> builtins.list[str]:
        before_call("list", prefix, self.uri)
        from google.cloud.storage.retry import DEFAULT_RETRY

        full = self._name(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        with self._bucket_there():
            names = [
                b.name[strip:]
                for b in self.client.list_blobs(self.bucket_name, prefix=full, retry=DEFAULT_RETRY)  # type: ignore[attr-defined]
            ]
        return sorted(names)

    def checksums(self, prefix: str = "") -> dict[str, builtins.list[int]]:
        """``{key relative to prefix: [size, crc32c]}``: GCS keeps both for every object.

        (An emulator that keeps no CRC32C: the object is read and summed here.)
        """
        before_call("checksums", prefix, self.uri)
        import base64

        import google_crc32c
        from google.cloud.storage.retry import DEFAULT_RETRY

        base = self._name(prefix.rstrip("/")) + "/" if prefix else (self.prefix + "/" if self.prefix else "")
        out = {}
        for b in self.client.list_blobs(self.bucket_name, prefix=base, retry=DEFAULT_RETRY):  # type: ignore[attr-defined]
            if b.crc32c:
                crc = int.from_bytes(base64.b64decode(b.crc32c), "big")
                size = int(b.size)
            else:
                data = b.download_as_bytes(retry=DEFAULT_RETRY)
                crc, size = google_crc32c.value(data), len(data)
            out[b.name[len(base) :]] = [size, crc]
        return out

    def usage(self, prefix: str) -> tuple[int, float | None]:
        """(bytes, newest write time) of the objects under ``prefix``; (0, None) when there is none."""
        before_call("usage", prefix, self.uri)
        from google.cloud.storage.retry import DEFAULT_RETRY

        total, newest = 0, None
        base = self._name(prefix.rstrip("/")) + "/"
        for blob in self.client.list_blobs(self.bucket_name, prefix=base, retry=DEFAULT_RETRY):  # type: ignore[attr-defined]
            total += int(blob.size or 0)
            if blob.updated is not None:
                t = blob.updated.timestamp()
                newest = t if newest is None else max(newest, t)
        return total, newest

    def create_in(self, reserve: str, key: str, data: bytes) -> None:
        """``create`` (a bucket does not fill up: the reserve is only given back)."""
        self.create(key, data)
        self.delete(reserve)

    def move(self, src: str, dst: str) -> None:
        """Copy then delete, object by object (GCS has no rename)."""
        before_call("move", src, self.uri)
        from google.cloud.storage.retry import DEFAULT_RETRY

        src_p = src.rstrip("/")
        keys = self.list(src_p + "/") or ([src_p] if self.exists(src_p) else [])
        for key in keys:
            blob = self.bucket.blob(self._name(key))
            dest = self._name(dst.rstrip("/") + key[len(src_p) :])
            self.bucket.copy_blob(blob, self.bucket, dest, retry=DEFAULT_RETRY)
        self.delete(src_p)

    def delete(self, key: str) -> None:
        before_call("delete", key, self.uri)
        from google.api_core import exceptions

        # The object itself and everything "inside" it (key/...), never key2...
        under = self.list(key.rstrip("/") + "/")
        names = [self._name(k) for k in under] + ([self._name(key)] if not key.endswith("/") else [])
        # Batch deletes: one HTTP round trip per 100 objects.
        for i in range(0, len(names), 100):
            with self.client.batch(raise_exception=False):  # type: ignore[attr-defined]
                for name in names[i : i + 100]:
                    try:
                        self.bucket.blob(name).delete()
                    except exceptions.NotFound:
                        pass


def gcs_client() -> object:
    """A storage client; anonymous against an emulator (``STORAGE_EMULATOR_HOST``)."""
    from google.cloud import storage  # type: ignore[attr-defined,unused-ignore]

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(
            project=os.environ.get("GOOGLE_CLOUD_PROJECT", "local"), credentials=AnonymousCredentials()
        )
    try:
        return storage.Client()
    except OSError:  # credentials without a project: objects need none (only listing and making buckets do)
        return storage.Client(project=None)


# Write errors a run root keeps giving (a retry cannot help).
LASTING_WRITE_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM})
# What a gs:// root raises when it cannot be reached for now (the client's own retries ran out).
_TRANSIENT_GCS = frozenset(
    {
        "RetryError",
        "ServiceUnavailable",
        "InternalServerError",
        "TooManyRequests",
        "BadGateway",
        "GatewayTimeout",
        "DeadlineExceeded",
        "TransportError",
    }
)


def is_transient(e: BaseException) -> bool:
    """Is ``e`` a store failing for now (unreachable, slow, overloaded), not one that will keep failing?"""
    if isinstance(e, OSError):
        return e.errno not in LASTING_WRITE_ERRORS and not isinstance(e, RootGone)
    return any(c.__module__.startswith("google.") and c.__name__ in _TRANSIENT_GCS for c in type(e).__mro__)


def disturb(root: str, for_s: float, latency_s: float = 0.0) -> None:
    """For ``for_s`` seconds, every call of this process to a store under ``root`` fails (or, with
    ``latency_s``, waits that long): as a store of that kind fails when it cannot be reached."""
    local = bool(root) and scheme(root).filesystem
    under = str(Path(root).expanduser().resolve()) if local else root.rstrip("/")
    disturb_calls(under, for_s, latency_s, scheme_of(under).unreachable)


def open_store(uri: str) -> Store:
    """The store of a URI, of the scheme its prefix names (``scheme_of``)."""
    return scheme_of(uri).open(uri)


@storage_scheme
class FileScheme(StorageScheme):
    """A local (or mounted) directory tree: any URI no other scheme claims."""

    name = "file"
    prefix = ""

    def traits(self, uri: str) -> Scheme:
        return Scheme("file", True, False, True, False)

    def open(self, uri: str) -> Store:
        return LocalStore(Path(uri).expanduser().resolve())


@storage_scheme
class GCSScheme(StorageScheme):
    """``gs://bucket/prefix``: Google Cloud Storage (or its emulator at ``STORAGE_EMULATOR_HOST``)."""

    name = "gs"
    prefix = "gs://"

    def traits(self, uri: str) -> Scheme:
        return Scheme("gs", False, True, False, True)

    def open(self, uri: str) -> Store:
        return GCSStore(uri)

    def unreachable(self, op: str, key: str) -> Exception:
        from google.api_core.exceptions import RetryError, ServiceUnavailable

        return RetryError("Timeout of 120.0s exceeded (chaos)", ServiceUnavailable(f"{op} {key}: unreachable"))
