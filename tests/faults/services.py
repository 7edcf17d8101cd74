"""Stop and start the real services with their usual commands; always leave them running."""

from __future__ import annotations

import os
import subprocess
import time


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait(port: int, up: bool, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _port_open(port) == up:
            return
        time.sleep(0.2)
    raise RuntimeError(f"port {port} did not go {'up' if up else 'down'} in {seconds} s")


def _run(cmd: str) -> None:
    subprocess.run(cmd, shell=True, check=False, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=120)


def start_postgres() -> None:
    if not _port_open(5432):
        version = os.listdir("/etc/postgresql")[0]
        _run(f"pg_ctlcluster --skip-systemctl-redirect {version} main start")
        _wait(5432, True)


def restart_postgres(down_for: float = 2.0) -> None:
    version = os.listdir("/etc/postgresql")[0]
    try:
        _run(f"pg_ctlcluster --skip-systemctl-redirect {version} main stop -m fast")
        _wait(5432, False)
        time.sleep(down_for)
    finally:
        start_postgres()


def start_redis() -> None:
    if not _port_open(6379):
        os.makedirs("/var/lib/redis", exist_ok=True)
        os.makedirs("/var/log/redis", exist_ok=True)
        _run('redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" '
             "--appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log")
        _wait(6379, True)
        from tests.conftest import remark_redis

        remark_redis()  # the run's database stays its own


def restart_redis(down_for: float = 2.0) -> None:
    try:
        _run("redis-cli -p 6379 shutdown nosave")
        _wait(6379, False)
        time.sleep(down_for)
    finally:
        start_redis()


def start_rabbitmq() -> None:
    if not _port_open(5672):
        _run("rabbitmq-server -detached")
        _wait(5672, True, 120)
    _run("rabbitmqctl await_startup --timeout 120")


def restart_rabbitmq(down_for: float = 2.0) -> None:
    try:
        _run("rabbitmqctl stop")
        _wait(5672, False)
        time.sleep(down_for)
    finally:
        start_rabbitmq()


RESTART = {"rabbitmq": restart_rabbitmq, "redis": restart_redis}
