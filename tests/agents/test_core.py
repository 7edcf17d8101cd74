"""What the three adapters share (``sagaworker.agents._core``), framework-free."""

from __future__ import annotations

import asyncio

import pytest

from sagaworker import Sagaworker, ToolFailed
from sagaworker.agents._core import AgentTools, ArgumentsRefused, SagaClosed, failed_in


def test_a_call_on_a_saga_that_takes_no_more_steps_ends_the_run(sqlite_sw: Sagaworker) -> None:
    """Once the saga is failing, a new tool call is a ToolFailed (SagaClosed), which every
    adapter turns into the end of the run; bad arguments stay a retry for the model."""
    @sqlite_sw.tool()
    def lookup(city: str) -> str:
        """Look a city up."""
        return city

    sqlite_sw.rt.bus.publish_step = lambda *a, **k: True  # type: ignore[method-assign]
    sqlite_sw.rt.bus.send_failure = lambda *a, **k: None  # type: ignore[method-assign]
    saga = sqlite_sw.begin("closed-1")
    tools = AgentTools(saga, [lookup])
    tool = next(iter(tools))

    async def main() -> None:
        with pytest.raises(ArgumentsRefused, match="malformed arguments"):
            await tools.call(tool, "c0", [], {"town": "Porto"})
        saga.fail("the user gave up")
        with pytest.raises(SagaClosed, match="lookup was not called: saga 'closed-1' is "
                                             "failing") as caught:
            await tools.call(tool, "c1", ["Porto"], {})
        assert isinstance(caught.value, ToolFailed) and failed_in(caught.value) is caught.value

    asyncio.run(main())
    assert sqlite_sw.inspect("closed-1").entries == []
