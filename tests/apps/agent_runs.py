"""Durable agent runs whose model also calls plain function tools (not ``@sw.tool``s):
Pydantic AI and the OpenAI Agents SDK inside flows (tests/integration/test_agent_units.py).

A scripted model follows the plan the prompt carries: turn N answers with the tool calls
of ``plan[N]`` in one response (parallel tool calls when there are several), then with
its text. Every request it serves and every effect of a function tool is in the ledger.
The function tools:

- ``send_mail(key, to)``: mails (an effect that must not happen twice); ``to="slow"``:
  its first run takes 30 s (a worker is killed in it); ``to="pause"``: it takes 2 s (a
  sibling call fails meanwhile);
- ``explode(key)``: raises, after a moment (the sibling is in flight by then);
- ``measure(key)``: returns NaN, which the journal cannot hold (OpenAI Agents only).
"""

from __future__ import annotations

import json
import time
from typing import Any

from sagaworker._worker.replay import FlowContext
from tests.apps.cluster import AGENTS, _url, record, rows

__all__ = ["FLOWS"]


def send_mail(key: str, to: str) -> str:
    """Mail a note to someone (it cannot be unsent)."""
    first = not any(r.tool == "send_mail" for r in rows(_url[0], key))
    record(key, "effect", "send_mail", to=to)
    if to == "slow" and first:
        time.sleep(30)
    if to == "pause":
        time.sleep(2)
    return f"mailed {to}"


def explode(key: str) -> str:
    """Ask the mail server for its status (it refuses)."""
    time.sleep(0.5)
    record(key, "effect", "explode")
    raise RuntimeError("the mail server refused")


def measure(key: str) -> float:
    """Measure the room (the meter answers NaN: no JSON holds it)."""
    record(key, "effect", "measure")
    return float("nan")


def _plan(prompt: str) -> tuple[str, list[list[list[Any]]], Any]:
    data = json.loads(prompt)
    return data["key"], data["plan"], data.get("output")


def _expanded(args: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments, "@300kB" standing for a text of 300 kB (over the journal's
    SAGAWORKER_MAX_ARGS_BYTES; made here, so that no flow argument holds it)."""
    return {k: "x" * 300_000 if v == "@300kB" else v for k, v in args.items()}


def _failure(prompt: Any, key: str, turn: int) -> tuple[int, float | None] | None:
    """The provider's failure this send of ``turn`` meets, if the prompt scripts one:
    ``errors`` maps a turn to the (status, Retry-After) of its first sends, in order."""
    scripted = json.loads(prompt).get("errors") or {}
    failures = scripted.get(str(turn), [])
    sent = sum(1 for r in rows(_url[0], key) if (r.kind, r.tool) == ("model", f"turn-{turn}"))
    if sent > len(failures):  # (this send is in the ledger already)
        return None
    status, after = failures[sent - 1]
    return int(status), after


def _pai_model(messages: list[Any], info: Any) -> Any:
    from pydantic_ai.exceptions import ModelHTTPError
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart

    prompt = str(messages[0].parts[-1].content)
    key, plan, output = _plan(prompt)
    answer = json.loads(prompt).get("answer")
    turn = sum(isinstance(m, ModelResponse) for m in messages)
    record(key, "model", f"turn-{turn}")
    failure = _failure(prompt, key, turn)
    if failure is not None:  # the provider's own error, as Pydantic AI raises it
        status, after = failure
        raise ModelHTTPError(status, "scripted", body={"error": f"scripted {status}"},
                             headers={"retry-after": str(after)} if after else None)
    if turn < len(plan):  # a call may name its own tool-call id (a model reusing one)
        return ModelResponse(parts=[ToolCallPart(call[0], _expanded(call[1]),
                                                 tool_call_id=call[2] if len(call) > 2
                                                 else f"call-{turn}-{i}")
                                    for i, call in enumerate(plan[turn])])
    if answer is not None:  # "@NUL" stands for a NUL character (no journal holds one)
        return ModelResponse(parts=[TextPart(answer.replace("@NUL", "\x00"))])
    if output:  # the agent's structured output, through its output tool, with keys that
        # jsonb reorders (made here: a flow's own arguments come from the journal, already
        # in its form)
        counts = {"zz": 1, "a": 2, "bbb": 3}
        return ModelResponse(parts=[ToolCallPart("final_result", {"response": counts},
                                                 tool_call_id="call-out")])
    return ModelResponse(parts=[TextPart(f"done {key}")])


def _pai_agent(kind: str) -> Any:
    name = f"mailer_{kind}"
    if name not in AGENTS:
        from pydantic_ai import Agent
        from pydantic_ai.models.function import FunctionModel

        from sagaworker.agents import pydantic_ai as sw_agents

        sw, tools = AGENTS["tools"]
        durability = (sw_agents.Durability(sw, idempotent_tools={"send_mail"})
                      if kind == "idempotent" else
                      sw_agents.Durability(sw, model_retries=2) if kind == "two_tries"
                      else sw_agents.Durability(sw))
        AGENTS[name] = Agent(FunctionModel(_pai_model), name=name,
                             output_type=dict[str, int] if kind == "counts" else str,
                             capabilities=[durability], tools=[send_mail, explode],
                             toolsets=[sw_agents.flow_toolset(tools)])
    return AGENTS[name]


async def mail_run(s: FlowContext, key: str, plan: list[Any], kind: str = "plain",
                   answer: str | None = None, errors: dict[str, Any] | None = None) -> str:
    """A Pydantic AI agent run (``kind``: "idempotent" declares send_mail idempotent,
    "two_tries" gives model requests two tries; ``answer``: the model's last answer;
    ``errors``: the provider's failures, by turn: ``_failure``)."""
    result = await _pai_agent(kind).run(json.dumps({"key": key, "plan": plan,
                                                    "answer": answer, "errors": errors}))
    return str(result.output)


async def counted_run(s: FlowContext, key: str) -> str:
    """An agent whose output (a ``dict[str, int]``) the flow passes on to a step: the
    step's arguments must be the same on the first run and on every replay."""
    result = await _pai_agent("counts").run(json.dumps({"key": key, "plan": [],
                                                         "output": True}))
    done: str = await s.call("tests.apps.cluster.step", key, json.dumps(result.output))
    await s.call("tests.apps.cluster.step", key, "after")
    return done


def _oai_agent() -> Any:
    if "mailer_oai" not in AGENTS:
        from agents import Agent, Model, ModelResponse, Usage, function_tool
        from openai.types.responses import (
            ResponseFunctionToolCall,
            ResponseOutputMessage,
            ResponseOutputText,
        )

        from sagaworker.agents import openai_agents as sw_oai

        class Scripted(Model):
            async def get_response(self, system_instructions: Any, input: Any,
                                   *args: Any, **kwargs: Any) -> Any:
                items = [input] if isinstance(input, str) else list(input)
                first = items[0] if isinstance(items[0], str) else items[0]["content"]
                key, plan, _ = _plan(str(first))
                # a turn's first call id ends in -0: one per turn the model answered
                turn = sum(1 for i in items if isinstance(i, dict)
                           and i.get("type") == "function_call"
                           and str(i.get("call_id", "")).endswith("-0"))
                record(key, "model", f"turn-{turn}")
                failure = _failure(str(first), key, turn)
                if failure is not None:  # the OpenAI SDK's own error for the status
                    raise _openai_error(*failure)
                if turn < len(plan):
                    out: list[Any] = [ResponseFunctionToolCall(
                        id=f"fc-{turn}-{n}", call_id=f"call-{turn}-{n}", type="function_call",
                        name=name, arguments=json.dumps(_expanded(args)))
                        for n, (name, args) in enumerate(plan[turn])]
                else:
                    out = [ResponseOutputMessage(
                        id="msg", type="message", role="assistant", status="completed",
                        content=[ResponseOutputText(text=f"done {key}", type="output_text",
                                                    annotations=[], logprobs=[])])]
                return ModelResponse(output=out, usage=Usage(requests=1, input_tokens=10,
                                                             output_tokens=3), response_id=None)

            def stream_response(self, *args: Any, **kwargs: Any) -> Any:
                raise NotImplementedError

        _, tools = AGENTS["tools"]
        AGENTS["mailer_oai"] = Agent(
            name="mailer", model=Scripted(),
            tools=[function_tool(send_mail), function_tool(measure),
                   *sw_oai.flow_tools(tools)])
    return AGENTS["mailer_oai"]


async def mail_run_oai(s: FlowContext, key: str, plan: list[Any],
                       errors: dict[str, Any] | None = None) -> str:
    """The same run with the OpenAI Agents SDK (``sagaworker.agents.openai_agents.run``)."""
    from sagaworker.agents import openai_agents as sw_oai

    result = await sw_oai.run(_oai_agent(), json.dumps({"key": key, "plan": plan,
                                                        "errors": errors}))
    return str(result.final_output)


def _openai_error(status: int, after: float | None) -> Exception:
    import httpx
    import openai

    cls = {429: openai.RateLimitError, 400: openai.BadRequestError}.get(
        status, openai.InternalServerError)
    response = httpx.Response(status, request=httpx.Request("POST", "https://x/v1/responses"),
                              headers={"retry-after": str(after)} if after else None)
    err: Exception = cls(f"scripted {status}", response=response, body=None)
    return err


FLOWS = (mail_run, counted_run, mail_run_oai)
