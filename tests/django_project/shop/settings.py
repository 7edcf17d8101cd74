"""The test project's settings: its database is the one SHOP_DATABASE_URL names (the
journal's: sagaworker's settings are read from these, ``settings_from_django``)."""

import os

from sqlalchemy.engine import make_url

_db = make_url(os.environ["SHOP_DATABASE_URL"])

SECRET_KEY = "the-test-project-has-no-secret"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "127.0.0.1", "localhost"]
INSTALLED_APPS = ["tests.django_project.orders"]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "tests.django_project.shop.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {
    "default": {"ENGINE": "django.db.backends.postgresql", "NAME": _db.database,
                "USER": _db.username or "", "HOST": _db.host or "", "PORT": _db.port or ""},
    # another database of the project, not the journal's
    "other": {"ENGINE": "django.db.backends.postgresql", "NAME": "postgres",
              "USER": _db.username or "", "HOST": _db.host or "", "PORT": _db.port or ""},
    "legacy": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}

# sagaworker's settings, by the names of its environment variables
SAGAWORKER_REDACT = "card"
