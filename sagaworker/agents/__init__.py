"""sagaworker tools for LLM agent frameworks: a tool call is a saga step.

Each adapter is a module of its own, behind its framework's extra, imported only when
used: ``sagaworker.agents.pydantic_ai`` (``sagaworker[pydantic-ai]``),
``sagaworker.agents.openai_agents`` (``[openai-agents]``), ``sagaworker.agents.langchain``
(``[langchain]``). Importing one without its framework raises ``ConfigurationError``
naming the extra.

However a framework ends the run (its own exception type), ``failed_in(exc)`` finds the
``ToolFailed`` behind it: the step that failed, was rejected, or the saga that takes no
more steps (``SagaClosed``).
"""

from __future__ import annotations

from ._core import GatePending, SagaClosed, failed_in

__all__ = ["GatePending", "SagaClosed", "failed_in"]
