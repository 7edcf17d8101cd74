"""Which model-request failures pass (retried) and which last (the run fails), told from the
frameworks' own exceptions; the provider's Retry-After is followed, else a backoff."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from sagaworker._worker.model_retries import BACKOFF_CAP, next_try_in, provider_error

pai = pytest.importorskip("pydantic_ai.exceptions")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
REQ = httpx.Request("POST", "https://api.example.com/v1/responses")


def oai(cls: type, status: int, **headers: str) -> BaseException:
    err: BaseException = cls("the provider says no", response=httpx.Response(
        status, request=REQ, headers=headers), body=None)
    return err


@pytest.mark.parametrize(("exc", "passing"), [
    (pai.ModelHTTPError(503, "m"), True),
    (pai.ModelHTTPError(500, "m"), True),
    (pai.ModelHTTPError(429, "m"), True),
    (pai.ModelHTTPError(408, "m"), True),
    (pai.ModelHTTPError(400, "m"), False),
    (pai.ModelHTTPError(401, "m"), False),
    (pai.ModelHTTPError(404, "m"), False),
    (oai(openai.RateLimitError, 429), True),
    (oai(openai.InternalServerError, 502), True),
    (openai.APITimeoutError(REQ), True),
    (openai.APIConnectionError(request=REQ), True),
    (oai(openai.BadRequestError, 400), False),
    (oai(openai.AuthenticationError, 401), False),
    (httpx.ReadTimeout("slow", request=REQ), True),
    (httpx.ConnectError("refused", request=REQ), True),
    (TimeoutError(), True),
    (ConnectionResetError(), True),
    (ValueError("a bug"), False),
    (RuntimeError("content refused"), False),
])
def test_passing_and_lasting_errors(exc: BaseException, passing: bool) -> None:
    assert (next_try_in(exc, 1) is not None) is passing


def test_the_providers_error_is_found_in_the_cause_chain() -> None:
    """A framework's own error raised from the provider's (``raise ... from``)."""
    try:
        try:
            raise oai(openai.RateLimitError, 429)
        except Exception as inner:
            raise RuntimeError("the agent's request failed") from inner
    except RuntimeError as outer:
        assert next_try_in(outer, 1) is not None


def test_retry_after_is_followed_in_seconds_milliseconds_or_a_date() -> None:
    assert next_try_in(pai.ModelHTTPError(429, "m", headers={"Retry-After": "2"}), 1) == 2.0
    assert next_try_in(oai(openai.RateLimitError, 429, **{"retry-after": "3"}), 4) == 3.0
    assert next_try_in(oai(openai.RateLimitError, 429, **{"retry-after-ms": "1500"}), 1) == 1.5
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    wait = next_try_in(oai(openai.InternalServerError, 503, **{"retry-after": later}), 1)
    assert wait is not None and 25 <= wait <= 30


def test_without_retry_after_the_backoff_doubles_with_jitter_up_to_its_cap() -> None:
    exc = pai.ModelHTTPError(503, "m")
    for attempt, top in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (10, BACKOFF_CAP)]:
        waits = [next_try_in(exc, attempt) for _ in range(50)]
        assert all(w is not None and top / 2 <= w <= top for w in waits), (attempt, waits)
        assert len(set(waits)) > 1  # jittered: runs backing off together spread out


def test_the_reason_names_the_providers_status_and_message() -> None:
    assert provider_error(pai.ModelHTTPError(503, "gpt-x", body={"error": "overloaded"})) == (
        "ModelHTTPError (status 503): status_code: 503, model_name: gpt-x, body: "
        "{'error': 'overloaded'}")
    assert provider_error(oai(openai.AuthenticationError, 401)) == (
        "AuthenticationError (status 401): the provider says no")
    assert provider_error(ValueError("bad")) == "ValueError: bad"
