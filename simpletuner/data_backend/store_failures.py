"""How a request to an object store failed, from the exception its client raised: worth another attempt
(:data:`TRANSIENT_CODES`, connection and timeout errors), or which permanent failure it is (refused credentials,
no permission, no bucket, no object, an object rewritten since it was listed). Used by
:class:`~simpletuner.data_backend.object_store.ObjectStoreBackend`'s retry loop and its messages."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Mapping

#: Error codes (S3's, and HTTP statuses as text) worth another attempt.
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequests",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "429",
        "500",
        "502",
        "503",
        "504",
    }
)
#: The store did not accept who we are.
CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "AuthorizationHeaderMalformed",
        "NoCredentialsError",
        "PartialCredentialsError",
        "ProfileNotFound",
        "401",
    }
)
#: It did, but we may not do this.
DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "Forbidden", "403"})
#: The object is no longer the version a read asked for (``If-Match`` failed): it was rewritten.
CHANGED_CODES = frozenset({"PreconditionFailed", "412"})
#: Transport failures, by class name (botocore, aiohttp, urllib3, fsspec): worth another attempt.
TRANSIENT_CLASS_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ProxyConnectionError",
        "ServerDisconnectedError",
        "ClientConnectionError",
        "ClientOSError",
        "ClientPayloadError",
        "ServerTimeoutError",
        "IncompleteRead",
        "ResponseStreamingError",
        "ResponseParserError",
        "HTTPClientError",
        "FSTimeoutError",
        "ProtocolError",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
    }
)


class ObjectStoreError(OSError):
    """A request to the object store failed (after its retries, when the failure was transient)."""


class ObjectStoreAccessError(ObjectStoreError, PermissionError):
    """The store refused the credentials, or they may not read this."""


class ObjectChangedError(ObjectStoreError):
    """The object was rewritten after the listing: what it holds now is not the version the cache keys (made
    from the listed ETag) describe, so it is not read as that version."""


class ShortRead(OSError):
    """Fewer bytes came back than the listing promised (a cut-off body): retried like a dropped connection."""


class TagMismatch(OSError):
    """The tag of what was read is not the listed one (a store that ignores ``If-Match``, or a store read
    without it)."""


@dataclass(frozen=True)
class Failure:
    """What went wrong with one request: ``kind`` is ``transient``, ``credentials``, ``denied``, ``no_bucket``,
    ``no_object``, ``changed`` (rewritten since it was listed) or ``other``; ``code`` the store's error code or
    the exception's class; ``detail`` its message."""

    kind: str
    code: str
    detail: str


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        item = todo.pop(0)
        if item is None or any(item is s for s in seen):
            continue
        seen.append(item)
        todo += [item.__cause__, item.__context__]
    return seen


def _code_and_status(exc: BaseException) -> tuple[str | None, int | None]:
    response = getattr(exc, "response", None)  # botocore's ClientError
    if isinstance(response, Mapping):
        error = response.get("Error") or {}
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return (str(error["Code"]) if error.get("Code") else None), status if isinstance(status, int) else None
    status = getattr(exc, "status", None)  # aiohttp's ClientResponseError (fsspec's http)
    return None, status if isinstance(status, int) else None


def classify(exc: BaseException) -> Failure:  # noqa: C901
    """Whether ``exc`` (and what caused it) is worth another attempt, and which permanent failure it is if not."""
    chain = _chain(exc)
    detail = str(exc) or type(exc).__name__
    transient: Failure | None = None
    for item in chain:
        code, status = _code_and_status(item)
        names = {cls.__name__ for cls in type(item).__mro__}
        if code is None and status is not None:
            code = str(status)
        if code is None and names & CREDENTIAL_CODES:
            code = next(iter(names & CREDENTIAL_CODES))
        if code in CREDENTIAL_CODES:
            return Failure("credentials", code, str(item) or detail)
        if code in DENIED_CODES:
            return Failure("denied", code, str(item) or detail)
        if code == "NoSuchBucket":
            return Failure("no_bucket", code, str(item) or detail)
        if code in ("NoSuchKey", "404", "NotFound"):
            return Failure("no_object", code, str(item) or detail)
        if code in CHANGED_CODES or isinstance(item, TagMismatch):
            return Failure("changed", code or "ETag", str(item) or detail)
        if transient is None and (
            code in TRANSIENT_CODES
            or (status is not None and (status >= 500 or status == 429))
            or names & TRANSIENT_CLASS_NAMES
            or isinstance(item, (ConnectionError, TimeoutError, ShortRead))
            or (isinstance(item, OSError) and item.errno in _TRANSIENT_ERRNOS)
        ):
            transient = Failure("transient", code or type(item).__name__, str(item) or type(item).__name__)
    if transient is not None:
        return transient
    if isinstance(exc, FileNotFoundError):
        return Failure("no_object", "FileNotFoundError", detail)
    if isinstance(exc, PermissionError):
        return Failure("denied", "PermissionError", detail)
    return Failure("other", type(exc).__name__, detail)
