"""Does a worker started on the Celery app's module import a flow's module?

A worker knows the flows its ``-A`` module imports (directly or through the modules that
one imports), plus Celery's ``include``/``imports``. A producer that starts a flow declared
elsewhere (in the web app's own module, say) journals a saga no worker will replay: the
workers log ``flow_unknown`` for ever. This answers from what the producer's process has
loaded: the names bound in the app module, followed module by module. It can say "yes"
where a worker would not (a module imported for another reason), never "no" where it
would, except for modules a worker imports by other means (``autodiscover_tasks``): then
it cannot tell, and nothing is said.
"""

from __future__ import annotations

import collections
import sys
import types
from typing import Any

__all__ = ["reaches"]

_LIMIT = 2000  # modules followed at most (an app importing half of PyPI is not walked whole)


def reaches(app: Any, module: str) -> bool | None:
    """Whether ``module`` is imported by the app's main module (or named in Celery's
    include/imports): True, False, or None when that cannot be told here."""
    main = getattr(app, "main", None)
    root = sys.modules.get(main) if isinstance(main, str) else None
    if root is None or main == "__main__" or _autodiscovers(app):
        return None  # no app module to follow, or modules a worker finds by itself
    conf = app.conf
    named = {*(conf.get("include") or ()), *(conf.get("imports") or ())}
    if module in named or module == main:
        return True
    seen: set[str] = set()
    todo = collections.deque([root, *(sys.modules[n] for n in named if n in sys.modules)])
    while todo:  # breadth first: the app's own modules before the libraries they use
        if len(seen) >= _LIMIT:
            return None  # too many modules to tell
        mod = todo.popleft()
        if mod.__name__ in seen:
            continue
        seen.add(mod.__name__)
        if mod.__name__ == module:
            return True
        for value in list(vars(mod).values()):
            name = value.__name__ if isinstance(value, types.ModuleType) else getattr(
                value, "__module__", None)
            if isinstance(name, str) and name not in seen and name in sys.modules:
                todo.append(sys.modules[name])
    return False


def _autodiscovers(app: Any) -> bool:
    """``app.autodiscover_tasks()`` was called: a worker imports modules found then."""
    from celery import signals

    return any(key[1] == id(app) for key, _ in getattr(signals.import_modules, "receivers",
                                                       None) or ())
