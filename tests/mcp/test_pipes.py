"""stdio on the event loop (sagaworker/mcp/pipes.py): real pipes, no server process. The
"stdin" and "stdout" here are pipes of the test's own (never fds 0 and 1), claimed as
`sagaworker mcp` claims its standard streams."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from collections.abc import Callable

import anyio
import pytest

from sagaworker.mcp.pipes import pipe_stdio, pollable


def read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def socket_pair() -> tuple[int, int]:
    """Two connected sockets' fds (a Node host spawns its servers with libuv's sockets)."""
    a, b = socket.socketpair()
    return a.detach(), b.detach()


PAIRS: dict[str, Callable[[], tuple[int, int]]] = {"pipe": os.pipe, "socket": socket_pair}


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_lines_are_read_whole_and_messages_written_on_the_loop_with_stray_output_diverted(
        capfd: pytest.CaptureFixture[str], pair: str) -> None:
    """Lines as the SDK reads them (one past the loop's 64 KiB buffer, bad UTF-8 replaced,
    a last line without its newline); what the server writes reaches the wire whole;
    a stray write to "stdout" while serving goes to stderr, not the wire; "stdin" reads
    nothing meanwhile; after serving, both fds are the wire again, blocking."""
    stdin, host_w = PAIRS[pair]()  # the host writes host_w; the server reads stdin
    host_r, stdout = PAIRS[pair]()  # the server writes stdout; the host reads host_r
    long = "x" * 200_000
    sent = f'{{"a": 1}}\n{long}\n'.encode() + b"caf\xff\n" + b'{"last": true}'
    writer = threading.Thread(target=lambda: (os.write(host_w, sent), os.close(host_w)),
                              daemon=True)
    reply = "r" * 150_000  # more than the pipe holds: the host reads as it comes
    wire: list[bytes] = []
    host = threading.Thread(target=lambda: wire.append(read_all(host_r)), daemon=True)
    host.start()

    async def serve() -> list[str]:
        async with pipe_stdio(stdin, stdout) as pipes:
            assert pipes is not None
            lines, out = pipes
            os.write(stdout, b"stray\n")  # a tool's print, say
            assert os.read(stdin, 10) == b""  # the null device
            writer.start()
            with pytest.raises(RuntimeError, match="already served"):
                async with pipe_stdio(stdin, stdout):
                    pass
            got = [line async for line in lines]
            await out.write(reply + "\n")
            await out.flush()
            await out.write("second\n")
            await out.flush()
        return got

    got = anyio.run(serve)
    writer.join()
    assert got == ['{"a": 1}\n', long + "\n", "caf\ufffd\n", '{"last": true}']
    assert os.get_blocking(stdout) and os.get_blocking(stdin)
    os.write(stdout, b"after\n")  # the wire again
    os.close(stdout)
    host.join()
    assert wire == [f"{reply}\nsecond\nafter\n".encode()]
    assert "stray" in capfd.readouterr().err
    for fd in (stdin, host_r):
        os.close(fd)


def claimed(stdin: int, stdout: int) -> object:
    async def claim() -> object:
        async with pipe_stdio(stdin, stdout) as pipes:
            os.write(stdout, b"mine")  # not diverted: the host still gets it
            return pipes

    return anyio.run(claim)


def test_a_file_is_left_to_the_sdk() -> None:
    """A regular file is not pollable (the loop cannot wait on it): ``pipe_stdio`` gives
    None and claims nothing, so ``serve_stdio`` falls back to the SDK's threads."""
    with tempfile.TemporaryFile() as f:
        r, w = os.pipe()
        try:
            assert pollable(r) and pollable(w) and not pollable(f.fileno())
            assert claimed(f.fileno(), w) is None
            assert os.read(r, 10) == b"mine"
        finally:
            os.close(r)
            os.close(w)


def test_stdin_and_stdout_on_one_socket_are_left_to_the_sdk() -> None:
    """One socket for both (inetd, ``socat EXEC:``): the loop's writer would take each
    request for its peer closing; the SDK serves it."""
    mine, host = socket.socketpair()
    with mine, host:
        assert claimed(mine.fileno(), mine.fileno()) is None
        assert host.recv(10) == b"mine"


def test_stdout_and_stderr_on_one_pipe_are_left_to_the_sdk() -> None:
    """``2>&1``: serving stdout on the loop would make stderr non-blocking too."""
    r, w = os.pipe()
    stdin, host_w = os.pipe()
    saved = os.dup(2)
    try:
        os.dup2(w, 2)
        got = claimed(stdin, w)
    finally:
        os.dup2(saved, 2)
        for fd in (saved, r, w, stdin, host_w):
            if fd != r:
                os.close(fd)
    assert got is None
    assert os.read(r, 10) == b"mine"
    os.close(r)
