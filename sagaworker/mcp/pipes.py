"""stdio on the event loop: the host's pipes read and written without a thread per line.

The SDK's ``stdio_server`` reads stdin and writes stdout through ``anyio.wrap_file``: a
worker thread for each line read, and two for each message written (the write, the
flush). On a busy machine each hand-over waits for a core: a tool call added 0.2 to 1.5 ms
more through them (``bench.mcp_latency``, ``stdio_threads``). When both ends are pipes or
sockets (what a host that spawns the server gives it: OS pipes, or libuv's sockets from a
Node host), :func:`pipe_stdio` serves them on the loop itself and hands them to
``stdio_server`` as its streams.

What the SDK does for stdio, this keeps: while serving, fd 0 reads the null device and
fd 1 writes to stderr, so a tool's stray ``print`` never reaches the wire (the wire is
served from private duplicates); both are restored on exit. Left to the SDK's threads: a
regular file (``sagaworker mcp < requests.jsonl``: the loop cannot poll it), a terminal
(left non-blocking it would break the shell after exit), and two standard streams on one
pipe or socket (``_served_here``), and Windows.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager, suppress
from typing import BinaryIO, cast

__all__ = ["Lines", "Output", "pipe_stdio", "pollable"]


def pollable(fd: int) -> bool:
    """A pipe or a socket: what the loop can wait on without a thread."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


class Lines:
    """The lines of a stream as text (UTF-8, bad bytes replaced, as the SDK reads them),
    however long one is."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader

    def __aiter__(self) -> Lines:
        return self

    async def __anext__(self) -> str:
        parts: list[bytes] = []
        while True:
            try:
                parts.append(await self._reader.readuntil(b"\n"))
                break
            except asyncio.LimitOverrunError as e:  # longer than the buffer: take what is in
                parts.append(await self._reader.readexactly(e.consumed))
            except asyncio.IncompleteReadError as e:  # the end, maybe after a last line
                parts.append(e.partial)
                break
        line = b"".join(parts)
        if not line:
            raise StopAsyncIteration
        return line.decode("utf-8", errors="replace")


class Output:
    """Text written to a stream; ``flush`` waits until the pipe took it."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    async def write(self, text: str) -> None:
        self._writer.write(text.encode("utf-8"))

    async def flush(self) -> None:
        await self._writer.drain()


def _claim(fd: int, diversion: int, mode: str, stack: ExitStack) -> BinaryIO:
    """The wire of ``fd`` as a file of the loop's own, with ``fd`` pointed at ``diversion``
    until the stack closes; then the wire is back on ``fd``, in the blocking mode it had."""
    keep = os.dup(fd)
    stack.callback(os.close, keep)
    blocking = os.get_blocking(keep)

    def restore() -> None:
        os.dup2(keep, fd)
        with suppress(OSError):  # the loop made the shared description non-blocking
            os.set_blocking(fd, blocking)

    stack.callback(restore)
    wire = os.fdopen(os.dup(keep), mode, 0)
    stack.callback(wire.close)  # (idempotent: the loop's transport closes it too)
    os.dup2(diversion, fd)
    return cast(BinaryIO, wire)


def _stderr_or(null: int) -> int:
    """Where stray output goes while serving: stderr, or nowhere when it is closed."""
    return null if _identity(2) is None else 2


def _served_here(stdin: int, stdout: int) -> bool:
    """Both ends pollable, and no two standard streams on one pipe or socket: stdin and
    stdout on one socket (inetd, ``socat EXEC:``) would have the loop's writer take each
    request for its peer closing; stdout and stderr on one pipe (``2>&1``) would make
    stderr non-blocking too, and a long log line would lose its end."""
    if sys.platform == "win32" or not (pollable(stdin) and pollable(stdout)):
        return False
    ends = [end for end in map(_identity, (stdin, stdout, 2)) if end is not None]
    return len(set(ends)) == len(ends)


def _identity(fd: int) -> tuple[int, int] | None:
    """The pipe or socket (or file) behind ``fd``; None when ``fd`` is closed."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


#: the descriptors served now: a second claim of one while it is served is refused
_serving: set[int] = set()


@asynccontextmanager
async def pipe_stdio(stdin: int = 0, stdout: int = 1
                     ) -> AsyncIterator[tuple[Lines, Output] | None]:
    """``stdin`` and ``stdout`` served on the running loop while the context is open, or
    ``None`` when the caller must serve them otherwise (``_served_here``)."""
    if _serving & {stdin, stdout}:  # (diverted meanwhile: it would look like a terminal)
        raise RuntimeError(f"fds {stdin} and {stdout} are already served in this process")
    if not _served_here(stdin, stdout):
        yield None
        return
    loop = asyncio.get_running_loop()
    with ExitStack() as stack:
        _serving.update((stdin, stdout))
        stack.callback(_serving.difference_update, (stdin, stdout))
        null = os.open(os.devnull, os.O_RDWR)
        stack.callback(os.close, null)
        wire_in = _claim(stdin, null, "rb", stack)
        wire_out = _claim(stdout, _stderr_or(null), "wb", stack)
        reader = asyncio.StreamReader()
        read, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), wire_in)
        stack.callback(read.close)
        write, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, wire_out)
        # no high-water mark: a flush returns once the pipe took every byte. A message
        # still buffered at the end (its flush cancelled) is dropped, not left to a loop
        # that may no longer run while the wire turns blocking again
        stack.callback(lambda: write.abort() if write.get_write_buffer_size() else
                       write.close())
        write.set_write_buffer_limits(0)
        yield Lines(reader), Output(asyncio.StreamWriter(write, protocol, None, loop))
