"""A dataset in an object store (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ...) read through fsspec.

The URL is listed once (sizes and ETags); reads fetch bytes when needed, through one retry loop: transient
failures back off and retry up to ``max_retries``, permanent ones raise at once with what to fix
(:mod:`.store_failures`). A read returns the whole *listed version* of an object or raises (an object
rewritten since the listing: :class:`ObjectChangedError`, counted as an unreadable file), so no bytes of
another version are encoded under its cache key. Protocol packages are optional (``s3fs``: the ``s3``
extra); credentials come from the protocol's library or ``storage_options`` and are never logged.
See documentation/DATA_SOURCES.md, "Datasets in an object store".
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, TypeVar
from urllib.parse import urlsplit, urlunsplit

from simpletuner.configuration.dataset_sections import LOCAL_PROTOCOLS, url_protocol
from simpletuner.data_backend.base import normalize_extensions
from simpletuner.data_backend.store_failures import (
    Failure,
    ObjectChangedError,
    ObjectStoreAccessError,
    ObjectStoreError,
    ShortRead,
    TagMismatch,
    classify,
)

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.configuration.dataset_sections import InMemoryDatasetConfig, ObjectStoreDatasetConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest wait between two attempts, whatever the backoff has grown to.
MAX_BACKOFF_SECONDS = 30.0
#: The extra that installs a protocol's fsspec package, where this project has one.
PROTOCOL_EXTRAS = {"s3": "s3", "s3a": "s3"}


def open_filesystem(protocol: str, storage_options: Mapping[str, Any], dataset_id: str) -> Any:
    """A fresh fsspec filesystem for ``protocol`` with ``storage_options`` (never the shared instance cache).

    For S3 the retries of botocore and s3fs are switched off (unless ``config_kwargs.retries`` says otherwise):
    :class:`ObjectStoreBackend` counts the attempts itself, so ``max_retries`` means what it says.

    Raises:
        ImportError: the protocol's package is missing; the message names what to install.
        ValueError: fsspec knows no such protocol.
    """
    import fsspec
    from fsspec.registry import known_implementations

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        extra = PROTOCOL_EXTRAS.get(protocol)
        hint = known_implementations.get(protocol, {}).get("err") or str(exc)
        install = f"pip install -e '.[{extra}]'` in the simpletuner checkout, or `pip install s3fs" if extra else hint
        raise ImportError(
            f"dataset {dataset_id!r}: reading {protocol}:// URLs needs a package this Python does not have "
            f"({hint}): install it with `{install}`"
        ) from exc
    except ValueError:
        raise ValueError(
            f"dataset {dataset_id!r}: fsspec knows no protocol {protocol!r}: use one of s3://, gs://, az://, "
            "http(s)://, ... (`type: local` for a folder on this machine)"
        ) from None
    options = dict(storage_options)
    if protocol in ("s3", "s3a"):
        config_kwargs = dict(options.get("config_kwargs") or {})
        config_kwargs.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        options["config_kwargs"] = config_kwargs
    fs = cls(skip_instance_cache=True, **options)
    if protocol in ("s3", "s3a"):
        fs.retries = 1  # s3fs's own loop around each call (a class attribute): one attempt, ours retries
    return fs


@dataclass(frozen=True)
class _Object:
    size: int
    identity: str
    tag_field: str | None  # the listing's field that tells versions apart (``ETag``, ...); None: none given
    tag: str | None  # its value, as listed (an S3 ETag with its quotes, as If-Match takes it)
    version: str | None  # ``VersionId`` of a versioned bucket's listing


#: Listing fields that tell an object's versions apart, best first.
TAG_FIELDS = ("ETag", "etag", "md5Hash", "content_md5", "VersionId", "version_id", "LastModified", "mtime")


def _tag(info: Mapping[str, Any]) -> tuple[str, str] | tuple[None, None]:
    """``(field, value)`` of the first of :data:`TAG_FIELDS` ``info`` gives."""
    for field in TAG_FIELDS:
        if info.get(field):
            return field, str(info[field])
    return None, None


def _bare(tag: Any) -> str:
    """An ETag without its quotes (listings and responses differ in whether they keep them)."""
    return str(tag).strip('"')


def _identity(info: Mapping[str, Any], size: int) -> str:
    """ETag (or the store's content hash / version / mtime, whichever it gives) and size."""
    field, value = _tag(info)
    if field is None:
        return f"{size}:?"
    tag, version = _bare(value), info.get("VersionId")
    return f"{size}:{tag}" + (f":{version}" if version and field != "VersionId" else "")


class ObjectStoreBackend:
    """The objects under ``url`` (``s3://bucket/prefix``, the prefix may be empty), by POSIX path relative to it.

    ``list_files`` / ``exists`` / ``size`` / ``identity`` (``"{size}:{etag}"``) answer from the listing made when
    built; ``read`` / ``read_head`` return the listed version or raise :class:`ObjectChangedError`.
    ``storage_options`` go to the fsspec filesystem (or pass ``filesystem``, tests); ``max_retries`` further
    attempts after a transient failure, the first after ``retry_backoff_seconds``, doubling with jitter up to
    :data:`MAX_BACKOFF_SECONDS`; ``id`` names the dataset in messages.

    Raises ValueError (not a URL, refused credentials, no bucket, no files, a listing that failed every
    attempt) or ImportError (the protocol's package is missing).
    """

    def __init__(
        self,
        url: str,
        id: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        max_retries: int = 5,
        retry_backoff_seconds: float = 0.5,
        filesystem: Any = None,
    ):
        self.id = id
        protocol = url_protocol(url)
        if protocol is None or protocol in LOCAL_PROTOCOLS:
            raise ValueError(
                f"dataset {id!r}: {url!r} is not an object store URL: give `instance_data_dir` as s3://bucket/prefix "
                "(or gs://, az://, https://...); for a folder on this machine use `type: local`"
            )
        if max_retries < 0 or retry_backoff_seconds < 0:
            raise ValueError(f"dataset {id!r}: max_retries and retry_backoff_seconds must not be negative")
        self.url = url.rstrip("/")
        self.root = self.url  # what messages name as the dataset's place
        self.protocol = protocol
        self.max_retries = max_retries
        self.retry_backoff_seconds = retry_backoff_seconds
        self._storage_options = dict(storage_options or {})
        self._fs = filesystem
        self._fs_pid = os.getpid()
        self._root_path = self.fs._strip_protocol(self.url).rstrip("/")
        self._objects = self._list()
        self._paths = tuple(self._objects)

    def __repr__(self) -> str:  # never the storage options: they may hold a secret
        return f"ObjectStoreBackend(id={self.id!r}, url={self.url!r}, files={len(self._paths)})"

    @property
    def fs(self) -> Any:
        """The fsspec filesystem; a fresh one in a forked child (an async client does not survive a fork)."""
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs = open_filesystem(self.protocol, self._storage_options, self.id)
            self._fs_pid = os.getpid()
        return self._fs

    # --- requests, with retries ---
    def _with_retries(self, what: str, target: str, call: Callable[[], T]) -> T:
        """``call()``, again after each transient failure (up to ``max_retries`` more times); a permanent
        failure, or the last transient one, raised as the error that says what to fix."""
        for attempt in range(self.max_retries + 1):
            try:
                return call()
            except Exception as exc:  # noqa: BLE001 - classified: transient ones retried, the rest re-raised
                failure = classify(exc)
                if failure.kind != "transient" or attempt == self.max_retries:
                    raise self._error(what, target, failure, attempt + 1) from exc
                wait = min(self.retry_backoff_seconds * 2**attempt, MAX_BACKOFF_SECONDS) * random.uniform(0.5, 1.0)
                logger.warning(
                    "dataset %r: %s %s failed (%s: %s); attempt %d of %d in %.2f s",
                    self.id,
                    what,
                    target,
                    failure.code,
                    failure.detail,
                    attempt + 2,
                    self.max_retries + 1,
                    wait,
                )
                time.sleep(wait)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _credentials_hint(self) -> str:
        if self.protocol in ("s3", "s3a"):
            return (
                "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary ones) or "
                "AWS_PROFILE in the environment, or the dataset's `storage_options` `key` / `secret` (or `profile`); "
                "for a store other than AWS also `storage_options.endpoint_url` (or AWS_ENDPOINT_URL)"
            )
        return f"give the credentials of the {self.protocol}:// store in the dataset's `storage_options`"

    def _error(self, what: str, target: str, failure: Failure, attempts: int) -> OSError:
        where = f"dataset {self.id!r}: {what} {target}"
        if failure.kind == "credentials":
            return ObjectStoreAccessError(
                f"dataset {self.id!r}: the object store at {self.url} refused the credentials ({failure.code}: "
                f"{failure.detail}): {self._credentials_hint()}"
            )
        if failure.kind == "denied":
            return ObjectStoreAccessError(
                f"{where}: access denied ({failure.code}: {failure.detail}): the credentials were accepted but may not "
                "do this; for S3 they need s3:ListBucket on the bucket and s3:GetObject on its objects"
            )
        if failure.kind == "no_bucket":
            return FileNotFoundError(
                f"dataset {self.id!r}: the bucket {self._bucket()!r} of {self.url} does not exist ({failure.code}): "
                "check the bucket name in `instance_data_dir` (and `storage_options.endpoint_url` for a store other "
                "than AWS)"
            )
        if failure.kind == "no_object":
            return FileNotFoundError(f"{where}: no such object ({failure.code}: {failure.detail})")
        if failure.kind == "changed":
            return ObjectChangedError(
                f"dataset {self.id!r}: {target} changed after it was listed at the start of the run ({failure.code}: "
                f"{failure.detail}); it is not read, since its cache entries are keyed by the listed version and would "
                "not describe what it holds now. Run again to list it anew and train on its new content, and do not "
                "rewrite a dataset's objects while a run reads them"
            )
        if failure.kind == "transient":
            retries = (
                f"{self.max_retries} retries, the first after {self.retry_backoff_seconds:g} s, then doubling"
                if self.max_retries
                else "no retries: `max_retries` is 0"
            )
            return ObjectStoreError(
                f"{where} failed {attempts} time(s) ({failure.code}: {failure.detail}; {retries}) at "
                f"{self._endpoint()}: the store kept failing. Check that it is running and that its endpoint (host "
                "and port) is right, and the network; if it is only starting or overloaded, raise the dataset's "
                "`max_retries` / `retry_backoff_seconds`"
            )
        return ObjectStoreError(f"{where} failed ({failure.code}: {failure.detail}) at {self._endpoint()}")

    def _bucket(self) -> str:
        return self._root_path.split("/", 1)[0]

    def _endpoint(self) -> str:
        """Which server the requests went to, and the setting that chose it (without any user:password)."""
        options = self._storage_options
        for name, endpoint in (
            ("storage_options.endpoint_url", options.get("endpoint_url")),
            ("storage_options.client_kwargs.endpoint_url", (options.get("client_kwargs") or {}).get("endpoint_url")),
            *((name, os.environ.get(name)) for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")),
        ):
            if endpoint and (name.startswith("storage") or self.protocol in ("s3", "s3a")):
                parts = urlsplit(str(endpoint))
                host = parts.netloc.rpartition("@")[2]
                return f"{urlunsplit(parts._replace(netloc=host)) if parts.netloc else endpoint} (from {name})"
        if self.protocol in ("s3", "s3a"):
            return "AWS's own S3 endpoint (no `storage_options.endpoint_url` or AWS_ENDPOINT_URL is set)"
        return f"the {self.protocol}:// store of {self.url}"

    # --- the listing ---
    def _list(self) -> dict[str, _Object]:
        try:
            found = self._with_retries("listing", self.url, lambda: self.fs.find(self._root_path, detail=True))
        except (PermissionError, FileNotFoundError) as exc:  # refused credentials, no permission, no bucket
            raise ValueError(str(exc)) from exc.__cause__
        except OSError as exc:  # down, a wrong port, 5xx after every retry: nothing can start without the listing
            raise ValueError(f"{exc}. The dataset is listed when a run starts; nothing was trained") from exc
        objects: dict[str, _Object] = {}
        prefix = self._root_path + "/"
        for name, info in found.items():
            name = str(name)
            if info.get("type", "file") != "file" or name.endswith("/") or not name.startswith(prefix):
                continue  # folder markers; the root itself when the URL names one object
            rel = name[len(prefix) :]
            if any(part.startswith(".") for part in rel.split("/")) or not rel:
                continue
            size = int(info.get("size") or 0)
            field, tag = _tag(info)
            objects[rel] = _Object(size, _identity(info, size), field, tag, info.get("VersionId") or None)
        if not objects:
            raise ValueError(
                f"dataset {self.id!r}: no files under {self.url} (the listing is recursive; names starting with '.' "
                "are skipped): check the bucket and prefix in `instance_data_dir`"
            )
        logger.info("dataset %r: listed %d objects under %s", self.id, len(objects), self.url)
        return dict(sorted(objects.items()))

    def _key(self, path: str) -> str:
        rel = PurePosixPath(str(path).replace("\\", "/"))
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ValueError(
                f"dataset {self.id!r}: path {path!r} is not a relative path inside {self.url}; "
                "use a path as returned by list_files()"
            )
        return rel.as_posix()

    def _object(self, path: str) -> _Object:
        obj = self._objects.get(path) or self._objects.get(self._key(path))
        if obj is None:
            raise FileNotFoundError(
                f"dataset {self.id!r}: no file {path!r} (not among the {len(self._paths)} objects listed under "
                f"{self.url})"
            )
        return obj

    # --- the DataBackend protocol ---
    def list_files(self, extensions: Iterable[str] | None = None) -> list[str]:
        """Relative POSIX paths of every object listed under the URL (recursive, sorted, hidden skipped)."""
        wanted = normalize_extensions(extensions)
        if wanted is None:
            return list(self._paths)
        return [p for p in self._paths if os.path.splitext(p)[1].lower() in wanted]

    def _fetch(self, path: str, num_bytes: int | None) -> bytes:
        """The first ``num_bytes`` (None: all) of the listed version of ``path``; ObjectChangedError when the
        object holds another version now (its cache keys, made from the listing, would not describe them)."""
        obj = self._object(path)
        key = self._key(path)
        full = f"{self._root_path}/{key}"
        expected = obj.size if num_bytes is None or num_bytes < 0 else min(num_bytes, obj.size)

        def call() -> bytes:
            if expected == 0:
                return b""
            end = None if expected == obj.size else expected
            if self._reads_by_etag(obj):
                data, tag = self._get_if_match(full, obj, end)
            else:
                data = self.fs.cat_file(full) if end is None else self.fs.cat_file(full, start=0, end=end)
                tag = self._tag_now(full, obj)
            if tag is not None and _bare(tag) != _bare(obj.tag):
                raise TagMismatch(f"listed {obj.tag_field} {obj.tag}, now {tag}")
            if len(data) != expected:
                raise ShortRead(
                    f"{len(data)} bytes came back, {expected} expected (the object changed since it was listed, or "
                    "the body was cut off)"
                )
            return data

        return self._with_retries("reading", f"{self.url}/{key}", call)

    def _reads_by_etag(self, obj: _Object) -> bool:
        """Whether reads of ``obj`` ask for the listed version itself (S3: ``If-Match`` with the listed ETag)."""
        return self.protocol in ("s3", "s3a") and obj.tag_field == "ETag" and hasattr(self.fs, "_call_s3")

    def _get_if_match(self, full: str, obj: _Object, end: int | None) -> tuple[bytes, str | None]:
        """One S3 GET of the listed version (``If-Match``: a rewritten object answers 412 PreconditionFailed;
        ``VersionId`` when the listing gave one), bytes ``[0, end)`` or all; and the ETag that came back, so a
        store that ignores ``If-Match`` is caught too."""
        from fsspec.asyn import sync

        fs = self.fs
        bucket, key, _ = fs.split_path(full)
        request = {"Bucket": bucket, "Key": key, "IfMatch": f'"{_bare(obj.tag)}"'}  # an entity tag is quoted
        if obj.version:
            request["VersionId"] = obj.version
        if end is not None:
            request["Range"] = f"bytes=0-{end - 1}"

        async def get() -> tuple[bytes, str | None]:
            response = await fs._call_s3("get_object", **request)
            try:
                return await response["Body"].read(), response.get("ETag")
            finally:
                response["Body"].close()

        return sync(fs.loop, get)

    def _tag_now(self, full: str, obj: _Object) -> str | None:
        """The object's tag as the store gives it after a plain read (stores without a conditional read):
        a rewrite that landed before the read shows here. None when the listing gave no tag to compare."""
        if obj.tag_field is None:
            return None
        self.fs.invalidate_cache(full)  # the listing may have filled fsspec's cache of file details
        value = self.fs.info(full).get(obj.tag_field)
        return None if value is None else str(value)

    def read(self, path: str) -> bytes:
        """The whole listed version of the object (all of it or an error: never part); FileNotFoundError naming it
        if it is not listed, ObjectChangedError if it was rewritten since."""
        return self._fetch(path, None)

    def read_head(self, path: str, num_bytes: int) -> bytes:
        """Up to ``num_bytes`` bytes from the start of ``path``: one ranged GET."""
        return self._fetch(path, num_bytes)

    def exists(self, path: str) -> bool:
        """Whether ``path`` was listed."""
        return path in self._objects or self._key(path) in self._objects

    def size(self, path: str) -> int:
        """Size of ``path`` in bytes, from the listing."""
        return self._object(path).size

    def identity(self, path: str) -> str:
        """``"{size}:{etag}"`` from the listing: changes when the object is rewritten."""
        return self._object(path).identity


def backend_from_options(
    url: str, dataset_id: str, options: ObjectStoreDatasetConfig | InMemoryDatasetConfig
) -> ObjectStoreBackend:
    """An :class:`ObjectStoreBackend` from a dataset entry carrying ``storage_options``, ``max_retries`` and
    ``retry_backoff_seconds`` (``object_store``, or ``in_memory`` staging a URL)."""
    return ObjectStoreBackend(
        url,
        dataset_id,
        storage_options=options.storage_options,
        max_retries=options.max_retries,
        retry_backoff_seconds=options.retry_backoff_seconds,
    )


def build_object_store_backend(dataset_cfg: ObjectStoreDatasetConfig, config: TrainingConfig) -> ObjectStoreBackend:
    """The ``object_store`` entry of ``data_backend.factory.BUILDERS``: ``dataset_cfg.instance_data_dir`` listed."""
    return backend_from_options(dataset_cfg.instance_data_dir, dataset_cfg.id, dataset_cfg)
