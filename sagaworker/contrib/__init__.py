"""Integrations with web frameworks, each behind its extra and imported only when used:
``sagaworker.contrib.django`` (``sagaworker[django]``). Importing one without its
framework raises ``ConfigurationError`` naming the extra."""
