"""What Celery is handed when a task raises: a fresh exception of the same name built from
redacted text, never the original (its cause, notes, custom ``__str__`` and dict
arguments would reach Celery's task events). The real-worker check is
tests/integration/test_task_events.py."""

from __future__ import annotations

import inspect
import pickle
import traceback

import pytest
from celery.exceptions import Retry

from sagaworker import REDACTED
from sagaworker._observe.redact import error_text, secret_values
from sagaworker._observe.sanitize import celery_safe, is_sanitized, sanitized, sanitized_retry

CARD = "4111222233334444"
KEYS = frozenset({"card"})


class Declined(Exception):
    pass


class Quoting(Exception):
    def __init__(self, card: str) -> None:
        super().__init__("declined")
        self.card = card

    def __str__(self) -> str:
        return f"card {self.card} declined"


def _chained() -> Exception:
    try:
        raise ValueError(f"card {CARD}")
    except ValueError as inner:
        outer = Declined("payment failed")
        outer.__cause__ = inner
        outer.add_note(f"card was {CARD}")
        return outer


@pytest.mark.parametrize("exc", [Declined({"card": CARD, "status": "no"}), _chained(),
                                 Quoting(CARD), Declined(f"card {CARD} declined")],
                         ids=["dict", "cause-and-note", "custom-str", "plain"])
def test_a_sanitized_copy_has_the_name_and_nothing_else(exc: Exception) -> None:
    copy = sanitized(exc, KEYS, [CARD])
    assert copy is not exc and is_sanitized(copy) and not is_sanitized(exc)
    assert type(copy).__name__ == type(exc).__name__ and isinstance(copy, type(exc))
    assert copy.__cause__ is None and copy.__context__ is None
    assert not hasattr(copy, "__notes__") and len(copy.args) == 1
    text = "".join(traceback.format_exception(copy)) + repr(copy) + str(copy)
    assert CARD not in text
    again = pickle.loads(pickle.dumps(copy))  # a prefork child hands it to the worker
    assert type(again) is type(copy) and again.args == copy.args


def test_the_redacted_text_keeps_what_is_not_secret() -> None:
    assert str(sanitized(Quoting(CARD), KEYS, [CARD])) == f"card {REDACTED} declined"
    assert str(sanitized(Declined({"card": "x", "status": "no"}), KEYS, [])) == (
        f"{{'card': '{REDACTED}', 'status': 'no'}}")
    assert error_text(Quoting(CARD), None, [], {"card": CARD}, KEYS) == (
        f"Quoting: card {REDACTED} declined")


def test_celery_safe_raises_a_copy_with_no_context() -> None:
    def boom() -> None:
        raise _chained()

    with pytest.raises(Declined) as info:
        celery_safe(boom, KEYS, lambda: [CARD])
    assert is_sanitized(info.value) and info.value.__context__ is None
    assert CARD not in "".join(traceback.format_exception(info.value))


def test_a_retry_is_rebuilt_around_a_sanitized_exception() -> None:
    retry = Retry(exc=Declined(f"card {CARD} busy"), when=3)
    assert CARD in str(retry)
    clean = sanitized_retry(retry, KEYS, [CARD])
    assert str(clean) == f"Retry in 3s: Declined('card {REDACTED} busy')"
    assert is_sanitized(clean.exc)


def test_a_left_out_default_is_a_secret_value() -> None:
    def charge(key: str, card: str = CARD, opts: dict | None = None) -> None:  # type: ignore[type-arg]
        pass

    sig = inspect.signature(charge)
    assert CARD in secret_values(sig, ["k"], {}, KEYS)
    assert secret_values(sig, ["k", "4000000000000002"], {}, KEYS) == ["4000000000000002"]
