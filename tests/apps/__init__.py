"""Helper apps the tests run in real worker processes (celery -A tests.apps.NAME)."""
