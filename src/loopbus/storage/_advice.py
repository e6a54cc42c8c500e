"""What a failed call to a store means and what to do about it: a call abandoned at its
deadline (:class:`Overdue`), the failure on one line, whether another try can mend it,
and the advice an error message gives (credentials, endpoint, bucket, deadline).

Imports the standard library only: the backends' errors are recognized by their class
names, so that no backend package is imported to word a failure.
"""

from __future__ import annotations

__all__ = ["Overdue", "bucket_of", "describe_failure", "fix_for", "missing_bucket", "not_retried"]


class Overdue(TimeoutError):
    """A store call abandoned at its deadline (``call_s``)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(
            f"no answer within {seconds:g} s (StoreDeadlines.call_s), so it was abandoned"
        )


def describe_failure(exc: BaseException) -> str:
    """What a failed call's error says, on one line."""
    text = " ".join(str(exc).split())
    return text if isinstance(exc, Overdue) else f"{type(exc).__name__}: {text}"


#: The backends' errors that another try cannot mend: no credentials at all (botocore's
#: ``NoCredentialsError``, ``PartialCredentialsError``), credentials in a bad shape.
_FINAL = ("NoCredentialsError", "PartialCredentialsError", "NoRegionError", "InvalidConfigError")


def not_retried(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is an error that another try cannot
    mend: a missing object, a refused permission, missing credentials."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (FileNotFoundError, PermissionError)) or any(
            kind.__name__ in _FINAL for kind in type(seen).__mro__
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def bucket_of(url: str) -> str:
    """The bucket (the first part after the scheme) of ``url``: ``s3://b/run`` -> ``b``."""
    return url.split("://", 1)[-1].split("/", 1)[0]


def missing_bucket(url: str) -> str:
    """What to say when the bucket of ``url`` is not there."""
    return (
        f"the bucket {bucket_of(url)} does not exist (or is not reachable with these "
        "credentials): create it or fix dirpath"
    )


def fix_for(exc: BaseException, url: str) -> str:
    """What to do about the failed call to ``url`` that raised ``exc``: provide
    credentials, fix the endpoint, create the bucket, raise a deadline."""
    if isinstance(exc, Overdue):
        return "raise StoreDeadlines.call_s if the store is slow rather than stalled"
    seen: BaseException | None = exc
    names: set[str] = set()
    while seen is not None:
        names |= {kind.__name__ for kind in type(seen).__mro__}
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    if names & {"NoCredentialsError", "PartialCredentialsError"}:
        return (
            "no credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "~/.aws/credentials, an instance role), or pass them as storage options "
            "({'key': ..., 'secret': ...})"
        )
    if "NoSuchBucket" in names or "specified bucket does not exist" in text:
        return missing_bucket(url)
    if isinstance(exc, PermissionError) or ("ClientError" in names and "Denied" in text):
        return (
            "the credentials were refused: check the key and secret (storage options or "
            "AWS_* variables) and that they may read and write this bucket"
        )
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionError"}:
        return (
            "the store could not be reached: check the endpoint (storage options' "
            "client_kwargs endpoint_url, or AWS_ENDPOINT_URL_S3) and the network"
        )
    return (
        "check that the store is reachable and that the endpoint and credentials in the "
        "storage options (or the backend's standard places, such as the AWS_* variables) "
        "are right"
    )
