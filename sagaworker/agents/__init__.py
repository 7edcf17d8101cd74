"""sagaworker tools for LLM agent frameworks: a tool call is a saga step.

Each adapter is a module of its own, behind its framework's extra, imported only when
used: ``sagaworker.agents.pydantic_ai`` (``sagaworker[pydantic-ai]``),
``sagaworker.agents.openai_agents`` (``[openai-agents]``), ``sagaworker.agents.langchain``
(``[langchain]``). Importing one without its framework raises ``ConfigurationError``
naming the extra.
"""
