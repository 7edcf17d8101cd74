"""The project's Celery app and Sagaworker, on sagaworker's settings read from Django's
(the journal in the Django database): what the views use and what ``sagaworker -A
tests.django_project.shop.sagas`` loads. The tools are the test app's."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_project.shop.settings")

from sagaworker.contrib.django import settings_from_django
from tests.apps.cluster import build

app, sw = build(settings_from_django())
