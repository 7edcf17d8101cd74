"""A producer that dies between the INTENT commit and the publish (the outbox case).

Usage: python -m tests.apps.producer_crash SAGA_ID KEY  (settings from SAGAWORKER_* variables)
       python -m tests.apps.producer_crash --many ID1 ID2 ...  (journals each, publishes none)
"""

from __future__ import annotations

import os
import sys

from tests.apps.cluster import build


def main() -> None:
    _, sw = build()
    if sys.argv[1] == "--many":
        sw.producer.publish = lambda *_: False  # type: ignore[method-assign]
        for saga_id in sys.argv[2:]:
            step = sw.registry.tool("tests.apps.cluster.step").task
            sw.begin(saga_id).enqueue(step, saga_id, "s1", sleep=0.05)
        os._exit(17)
    saga_id, key = sys.argv[1], sys.argv[2]

    def die(*_: object) -> bool:
        os._exit(17)  # the process is gone: INTENT is committed, nothing was published

    sw.producer.publish = die  # type: ignore[method-assign]
    saga = sw.begin(saga_id)
    saga.enqueue(sw.registry.tool("tests.apps.cluster.step").task, key, "orphaned")


if __name__ == "__main__":
    main()
