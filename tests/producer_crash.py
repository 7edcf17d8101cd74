"""A producer that dies between the INTENT commit and the publish (the outbox case).

Usage: python -m tests.producer_crash SAGA_ID KEY  (settings from SAGAWORKER_* variables)
"""

from __future__ import annotations

import os
import sys

from tests.app import build


def main() -> None:
    saga_id, key = sys.argv[1], sys.argv[2]
    _, sw = build()

    def die(*_: object) -> bool:
        os._exit(17)  # the process is gone: INTENT is committed, nothing was published

    sw.producer.publish = die  # type: ignore[method-assign]
    saga = sw.begin(saga_id)
    saga.enqueue(sw.registry.tool("tests.app.step").task, key, "orphaned")


if __name__ == "__main__":
    main()
