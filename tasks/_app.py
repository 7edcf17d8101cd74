"""The Celery app and the Sagaworker of the example (kept apart so the tools can import it)."""

from __future__ import annotations

from celery import Celery

from sagaworker import Sagaworker, Settings

app = Celery("tasks")
app.config_from_object("config.celery")
_settings = Settings()
# A card number is a secret: redacted everywhere arguments leave the library (logs,
# Celery's argsrepr, the CLI, the API, the dashboard) unless SAGAWORKER_REDACT names others.
sw = Sagaworker(app, settings=_settings if _settings.redact
                else _settings.model_copy(update={"redact": "card"}))
