"""Storage that cannot be used (an endpoint that does not answer, a bucket that does not exist,
access denied, no credentials) as one line naming the URL and what to do, never s3fs's or
botocore's exception.

The exceptions are recognised by their class names (and s3fs's translations into OSErrors), so
this module imports neither botocore nor aiohttp: s3fs is an optional extra, and other fsspec
back ends raise the same builtin errors.
"""

from __future__ import annotations

import contextlib
import os
import re
import urllib.parse
from collections.abc import Iterator
from typing import Protocol

from llmtrain.core_mesh.errors import UserError, no_space

# fsspec protocols whose first path component is a bucket (a container): a missing one is said so
BUCKET_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "r2", "oss")
# class names (anywhere in an exception's MRO) of the failures to reach a storage endpoint:
# botocore's ConnectionError (EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError,
# SSLError) and HTTPClientError (ReadTimeoutError, ConnectionClosedError), aiohttp's
# ClientConnectionError, fsspec's FSTimeoutError
_UNREACHABLE = {"ConnectionError", "HTTPClientError", "ClientConnectionError", "FSTimeoutError"}
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
# S3 error codes of a request refused for who made it
_DENIED_CODES = {
    "AccessDenied",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "403",
}


class StorageError(UserError):
    """Storage that cannot be reached, found or used with these credentials."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions behind it (causes and contexts), each once."""
    pending: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending.append(current.__cause__)
        if not current.__suppress_context__:  # `raise ... from None` ends the chain
            pending.append(current.__context__)


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _code(exc: BaseException) -> str | None:
    """The service's error code of a botocore ClientError."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = (response.get("Error") or {}).get("Code")
        return None if code is None else str(code)
    return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _file_on_the_path(exc: BaseException, url: str) -> str | None:
    """The file that stands where a folder of `url`'s path should be (a local OSError making
    or opening something below it), or None."""
    if not isinstance(exc, (NotADirectoryError, FileExistsError)):
        return None
    path = os.path.abspath(url.removeprefix("file://"))
    parent = os.path.dirname(path)
    while parent and parent != os.path.dirname(parent):
        if os.path.isfile(parent):
            return parent
        parent = os.path.dirname(parent)
    return None


def bucket_of(url: str) -> str | None:
    """The bucket of an object-storage URL (s3://bucket/key -> bucket), else None."""
    protocol, sep, rest = url.partition("://")
    if not sep or protocol not in BUCKET_PROTOCOLS:
        return None
    return rest.split("/", 1)[0] or None


def problem_of(exc: BaseException, url: str, *, doing: str = "read") -> str | None:
    """What a failure of storage comes down to, with what to do, or None when it is not one
    (`doing`: read or write, for the advice about permissions). A full disk is left to the
    caller's own message (`no_space`)."""
    if no_space(exc) is not None:
        return None
    local = "://" not in url or url.startswith("file://")
    for current in _chain(exc):
        names, code = _names(current), _code(current)
        if local and (file := _file_on_the_path(current, url)) is not None:
            return f"{file} is a file, not a folder: choose a path below a folder"
        if names & _NO_CREDENTIALS:
            return (
                f"no credentials for it ({_one_line(current)}): set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), the key and secret storage options, or "
                "anon=true for a public bucket"
            )
        if (
            names & _UNREACHABLE
            or isinstance(current, (ConnectionError, TimeoutError))
            or "gaierror" in names
        ):
            kwargs = getattr(current, "kwargs", None) or {}
            endpoint = kwargs.get("endpoint_url") if isinstance(kwargs, dict) else None
            at = ""
            if isinstance(endpoint, str):
                parts = urllib.parse.urlsplit(endpoint)
                at = f" {parts.scheme}://{parts.netloc}" if parts.netloc else f" {endpoint}"
            detail = re.sub(r':?\s*"[a-z]+://[^"]*"', "", _one_line(current))  # the URL again
            return (
                f"cannot reach the storage endpoint{at} ({detail}): check the endpoint_url "
                "storage option (or AWS_ENDPOINT_URL), the network, and that the service is up"
            )
        if code == "NoSuchBucket" or (
            isinstance(current, FileNotFoundError) and "bucket does not exist" in str(current)
        ):
            bucket = bucket_of(url)
            named = f"bucket {bucket!r}" if bucket else "its bucket"
            return f"{named} does not exist: create it, or correct the URL"
        if isinstance(current, PermissionError) and local:
            return (
                f"permission denied ({_one_line(current)}): check its permissions and those of "
                f"the folders above it, or {doing} as a user who may"
            )
        if isinstance(current, PermissionError) or code in _DENIED_CODES:
            return (
                f"access denied ({_one_line(current)}): check the credentials (AWS_PROFILE, "
                "AWS_ACCESS_KEY_ID, or the key and secret storage options) and that they may "
                f"{doing} it"
            )
    return None


@contextlib.contextmanager
def storage_errors(
    url: str, *, doing: str = "read", error: type[UserError] = StorageError
) -> Iterator[None]:
    """A storage failure inside becomes `error("URL: what happened; what to do")`; anything
    else (a UserError already, a bug, an interrupt) passes through as it is."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        problem = problem_of(exc, url, doing=doing)
        if problem is None:
            raise
        raise error(f"{url}: {problem}") from exc


class Probed(Protocol):
    """What `missing_bucket` asks of a file system (an fsspec one): whether a path exists."""

    def exists(self, path: str, /) -> bool: ...


def missing_bucket(fs: Probed, url: str) -> str | None:
    """For an object-storage URL whose object was not found: a message when its bucket is what
    is missing (asked only then: a bucket probe costs a request), else None."""
    bucket = bucket_of(url)
    if bucket is None:
        return None
    try:
        if fs.exists(bucket):
            return None
    except Exception:  # noqa: BLE001 - only a hint: a storage that cannot tell us is "unknown"
        return None
    return (
        f"{url}: bucket {bucket!r} does not exist (or these credentials cannot see it): create "
        "it, or correct the URL"
    )
