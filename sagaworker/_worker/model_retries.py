"""Which failures of a model request pass (a rate limit, an overloaded or failing provider, a
timeout, a lost connection) and how long its next try waits; any other failure lasts (a
bad request, an authentication error, a refused content) and fails the run.

Told from the frameworks' own exceptions, without importing them: Pydantic AI's
categorized ``ModelAPIError`` family and ``ModelHTTPError``'s status, the OpenAI (and
Anthropic) SDK's ``RateLimitError``/``APIStatusError``/``APITimeoutError``/
``APIConnectionError``, httpx's timeouts and network errors, and Python's own
``TimeoutError`` and ``ConnectionError``; the exception's cause chain is searched, as an
SDK or a framework raises its own error around the provider's.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

__all__ = ["BACKOFF_BASE", "BACKOFF_CAP", "next_try_in", "provider_error"]

#: the first backoff (seconds), doubled each try up to ``BACKOFF_CAP``, with jitter
BACKOFF_BASE = 1.0
BACKOFF_CAP = 60.0
#: the longest wait a provider's Retry-After is followed for (a day's ask is not)
RETRY_AFTER_CAP = 600.0
#: HTTP statuses that pass: timeout, conflict, too early, rate limit; and any 5xx
_PASSING_STATUS = frozenset({408, 409, 425, 429})
_PASSING_NAMES = frozenset({
    # Pydantic AI's categories
    "ModelRateLimitError", "ModelUnavailableError", "ModelServerError",
    "ModelConnectionError", "ModelRequestTimeout",
    # the OpenAI and Anthropic SDKs'
    "RateLimitError", "InternalServerError", "APITimeoutError", "APIConnectionError",
    "OverloadedError",
    # httpx's
    "TimeoutException", "NetworkError", "RemoteProtocolError"})
_LASTING_NAMES = frozenset({
    "ModelRequestRejectedError", "ModelQuotaExceededError", "ContentFilterError",
    "AuthenticationError", "PermissionDeniedError", "BadRequestError", "NotFoundError",
    "UnprocessableEntityError"})


def next_try_in(exc: BaseException, attempt: int) -> float | None:
    """Seconds before the next try of a model request whose try ``attempt`` (from 1)
    raised ``exc``: the provider's Retry-After where it sent one, else an exponential
    backoff with jitter; None when the error does not pass."""
    for e in _chain(exc):
        verdict = _verdict(e)
        if verdict is None:
            continue
        if not verdict:
            return None
        after = _retry_after(e)
        if after is not None:
            return min(after, RETRY_AFTER_CAP)
        backoff = min(BACKOFF_CAP, BACKOFF_BASE * 2.0 ** max(attempt - 1, 0))
        return float(backoff * random.uniform(0.5, 1.0))
    return None


def provider_error(exc: BaseException) -> str:
    """The error as a failed run's reason names it: its type, the provider's status where
    it has one, and its message."""
    status = next((s for e in _chain(exc) if isinstance(s := _status(e), int)), None)
    head = type(exc).__name__ + (f" (status {status})" if status is not None else "")
    return f"{head}: {exc}"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _verdict(e: BaseException) -> bool | None:
    """True: a passing error; False: a lasting one; None: this exception does not say."""
    names = {c.__name__ for c in type(e).__mro__}
    if names & _LASTING_NAMES:
        return False
    if names & _PASSING_NAMES:
        return True
    status = _status(e)
    if isinstance(status, int) and 400 <= status <= 599:
        return status in _PASSING_STATUS or status >= 500
    if isinstance(e, TimeoutError | ConnectionError):
        return True
    return None


def _status(e: BaseException) -> int | None:
    status = getattr(e, "status_code", None)
    if not isinstance(status, int):
        status = getattr(getattr(e, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def _retry_after(e: BaseException) -> float | None:
    """The wait the provider asked for: Pydantic AI's ``retry_after``, else the response's
    ``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP date)."""
    after = getattr(e, "retry_after", None)
    if isinstance(after, int | float) and not isinstance(after, bool):
        return max(float(after), 0.0)
    headers = getattr(e, "headers", None)
    if not isinstance(headers, Mapping):
        headers = getattr(getattr(e, "response", None), "headers", None)
    if not isinstance(headers, Mapping) and not hasattr(headers, "get"):
        return None
    return _parse(headers)


def _parse(headers: Any) -> float | None:
    try:
        ms = headers.get("retry-after-ms")
        if ms is not None:
            return max(float(ms) / 1000, 0.0)
        value = headers.get("retry-after") or headers.get("Retry-After")
    except (TypeError, ValueError):
        return None
    if not isinstance(value, str) or not value.strip():
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max((when - datetime.now(UTC)).total_seconds(), 0.0)
