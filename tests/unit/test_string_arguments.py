"""Redaction reads a tool call's arguments kept as a JSON string (as the OpenAI Agents SDK,
Pydantic AI and LangChain's ``additional_kwargs`` keep them) as the object they are."""

from __future__ import annotations

import json

from sagaworker._observe.redact import redact_value, secret_values


def test_listed_keys_inside_a_json_string_are_redacted() -> None:
    """The string is read, redacted by key at any depth, and written back as JSON; a string
    that holds no listed key, or no JSON, is left as it is."""
    call = {"type": "function_call", "name": "charge",
            "arguments": '{"card": "4111111111111111", "amount_cents": 3000, '
                         '"billing": {"card": "5500005555555559"}}'}
    assert redact_value(call, {"card"}) == {
        "type": "function_call", "name": "charge",
        "arguments": '{"card": "[REDACTED]", "amount_cents": 3000, '
                     '"billing": {"card": "[REDACTED]"}}'}
    for kept in ('{"amount_cents": 3000}', "{not json", "[1, 2]", "", "card"):
        assert redact_value({"arguments": kept}, {"card"}) == {"arguments": kept}


def test_a_json_string_inside_a_json_string_is_read_too() -> None:
    """LangChain's ``additional_kwargs`` nest the call's arguments one string deeper."""
    inner = json.dumps({"card": "4111111111111111"})
    outer = json.dumps({"tool_calls": [{"function": {"arguments": inner}}]})
    shown = json.loads(json.loads(redact_value({"raw": outer}, {"card"})["raw"])
                       ["tool_calls"][0]["function"]["arguments"])
    assert shown == {"card": "[REDACTED]"}


def test_values_inside_a_json_string_are_scrubbed_from_free_text() -> None:
    """A redacted value found in a string argument is a secret value too."""
    assert secret_values(None, [], {"payload": '{"card": "4111111111111111"}'},
                         {"card"}) == ["4111111111111111"]
