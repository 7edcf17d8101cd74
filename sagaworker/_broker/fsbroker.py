"""kombu's filesystem transport (the embedded broker), with messages written atomically.

kombu writes a message file in place (open, write, close) under an advisory lock that its
reader never takes, so a consumer polling the folder can move and read a file that is
still empty: ``JSONDecodeError: Expecting value`` in ``filesystem.Channel._get``, which
Celery reports as an "Unrecoverable error" and the worker stops (kombu 5.7.0; kombu issue
#1551 reports the same trace). It takes a busy folder: a producer and a worker exchanging
a few hundred messages a second on the embedded defaults hit it within seconds.

Here the message is written under a name no queue reads (a leading dot, a ``.part``
suffix) in the same folder, then renamed to its real name: a rename within a folder is
atomic, so a reader sees no file or the whole message. The file is created 0600 (the
folders 0700, ``celery_config``): a message carries the arguments in clear.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        part = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            # readable by its owner only: a message carries the arguments in clear
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))  # type: ignore[no-untyped-call]
            os.replace(part, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel
