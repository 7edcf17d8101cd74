#!/usr/bin/env python
"""Django's command line for the test project (``manage.py migrate`` makes its tables;
``sagaworker -A tests.django_project.shop.sagas db upgrade`` makes the journal's)."""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_project.shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
