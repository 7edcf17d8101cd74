"""stdio on the event loop: the host's pipes read and written without a thread per line.

The SDK's ``stdio_server`` reads stdin and writes stdout through ``anyio.wrap_file``: a
worker thread for each line read, and two for each message written (the write, the
flush). On a busy machine each hand-over waits for a core, and a tool call paid about
2 ms for them (``bench.mcp_latency``). When both ends are pipes or sockets (what a host
that spawns the server gives it), :func:`pipe_stdio` serves them on the loop itself and
hands them to ``stdio_server`` as its streams.

What the SDK does for stdio, this keeps: while serving, fd 0 reads the null device and
fd 1 writes to stderr, so a tool's stray ``print`` never reaches the wire (the wire is
served from private duplicates); both are restored on exit. A terminal or a regular file
(``sagaworker mcp < requests.jsonl``) is left to the SDK's threads: the loop cannot poll a
file, and a terminal left non-blocking would break the shell after exit.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager

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


def _claim(fd: int, diversion: int, stack: ExitStack) -> int:
    """A private duplicate of ``fd`` (the wire), with ``fd`` pointed at ``diversion`` until
    the stack closes; then the wire is back on ``fd``, blocking again."""
    keep = os.dup(fd)
    stack.callback(os.close, keep)

    def restore() -> None:
        os.set_blocking(keep, True)  # the loop made the shared description non-blocking
        os.dup2(keep, fd)

    stack.callback(restore)
    os.dup2(diversion, fd)
    return os.dup(keep)  # the loop's own: its transport closes it


def _stderr_or(null: int) -> int:
    """Where stray output goes while serving: stderr, or nowhere when it is closed."""
    try:
        os.fstat(2)
    except OSError:
        return null
    return 2


@asynccontextmanager
async def pipe_stdio(stdin: int = 0, stdout: int = 1
                     ) -> AsyncIterator[tuple[Lines, Output] | None]:
    """``stdin`` and ``stdout`` served on the running loop while the context is open, or
    ``None`` when either is not a pipe or socket (the caller serves them otherwise)."""
    if not (pollable(stdin) and pollable(stdout)):
        yield None
        return
    loop = asyncio.get_running_loop()
    with ExitStack() as stack:
        null = os.open(os.devnull, os.O_RDWR)
        stack.callback(os.close, null)
        wire_in = _claim(stdin, null, stack)
        wire_out = _claim(stdout, _stderr_or(null), stack)
        reader = asyncio.StreamReader()
        read, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(wire_in, "rb", 0))
        stack.callback(read.close)
        write, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(wire_out, "wb", 0))
        stack.callback(write.close)
        # no high-water mark: a flush returns once the pipe took every byte (a message is
        # never left in the loop's buffer when serving ends)
        write.set_write_buffer_limits(0)
        yield Lines(reader), Output(asyncio.StreamWriter(write, protocol, None, loop))
