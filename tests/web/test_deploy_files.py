"""Procfile, docker-compose.yml and Dockerfile: the right services, commands that start."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def procfile() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, cmd = line.partition(":")
            out[name.strip()] = shlex.split(cmd)
    return out


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def run(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``argv`` as the platform would run it: the venv's programs, the repo importable,
    an embedded journal in a scratch directory."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT),
           "SAGAWORKER_DATABASE_URL": f"sqlite:///{tmp_path / 'journal.db'}",
           "SAGAWORKER_BROKER_FOLDER": str(tmp_path / "broker")}
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_procfile_has_the_four_processes() -> None:
    """The Procfile declares release, web, worker and beat with the expected programs."""
    p = procfile()
    assert set(p) == {"release", "web", "worker", "beat"}
    assert p["release"] == ["sagaworker", "-A", "tasks", "db", "upgrade"]
    assert p["web"][0] == "gunicorn" and p["web"][-1] == "tasks.web:create_app()"
    assert p["worker"] == ["sagaworker", "-A", "tasks", "worker", "--loglevel=INFO"]
    assert p["beat"] == ["celery", "-A", "tasks", "beat", "--loglevel=INFO"]


@pytest.mark.parametrize("process", ["release", "web", "worker", "beat"])
def test_procfile_command_runs_with_help(process: str, tmp_path: Path) -> None:
    """Each Procfile command, with --help appended, exits 0 and prints its usage."""
    argv = procfile()[process]
    got = run([*argv, "--help"], tmp_path)
    assert got.returncode == 0, got.stderr[-2000:]
    assert "usage" in (got.stdout + got.stderr).lower()


def test_web_command_loads_the_app(tmp_path: Path) -> None:
    """gunicorn --check-config with the Procfile's web arguments imports create_app()."""
    got = run([*procfile()["web"], "--check-config"], tmp_path)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]


def test_compose_services() -> None:
    """docker-compose.yml has postgres, rabbitmq, web, worker and beat on one built image."""
    services = compose()["services"]
    assert {"postgres", "rabbitmq", "web", "worker", "beat"} <= set(services)
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["rabbitmq"]["image"].startswith("rabbitmq:")
    app = [services[s] for s in ("web", "worker", "beat", "migrate")]
    assert {s["build"] for s in app} == {"."} and len({s["image"] for s in app}) == 1
    assert (ROOT / "Dockerfile").read_text().startswith("#")
    for s in app:
        env = s["environment"]
        assert env["SAGAWORKER_DATABASE_URL"].startswith("postgresql+psycopg://")
        assert "@postgres:5432/" in env["SAGAWORKER_DATABASE_URL"]
        assert env["SAGAWORKER_BROKER_URL"].startswith("amqp://")
        assert "@rabbitmq:5672" in env["SAGAWORKER_BROKER_URL"]


def test_compose_commands_match_the_procfile() -> None:
    """Compose runs the Procfile's commands (beat with a writable schedule file)."""
    p, services = procfile(), compose()["services"]
    assert services["migrate"]["command"] == p["release"]
    assert services["web"]["command"] == p["web"]
    assert services["worker"]["command"] == p["worker"]
    assert services["beat"]["command"][:len(p["beat"])] == p["beat"]
    assert "127.0.0.1:8000:8000" in services["web"]["ports"]


def test_compose_publishes_no_unauthenticated_decision_endpoint() -> None:
    """The web app's port is published on 127.0.0.1 only, operators come from the
    environment as hashed tokens (unset: read-only), and no header is trusted on a port a
    client could reach directly; nothing else is published."""
    services = compose()["services"]
    web = services["web"]
    for port in web["ports"]:
        assert str(port).startswith("127.0.0.1:"), port
    env = web["environment"]
    assert env["SAGAWORKER_WEB_TOKENS"] == "${SAGAWORKER_WEB_TOKENS:-}"
    assert "SAGAWORKER_WEB_TRUSTED_HEADER" not in env
    assert [name for name, s in services.items() if "ports" in s] == ["web"]


def test_worker_is_scalable_and_shuts_down_warm() -> None:
    """The worker has no container_name or published ports (so --scale works) and gets
    SIGTERM with time to finish running tools."""
    w = compose()["services"]["worker"]
    assert "container_name" not in w and "ports" not in w
    assert w.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert w["stop_grace_period"]
    assert "deploy" not in w or "replicas" not in w["deploy"]


def test_everything_waits_for_migrations() -> None:
    """web, worker and beat start only after the migration step succeeded."""
    services = compose()["services"]
    for name in ("web", "worker", "beat"):
        dep = services[name]["depends_on"]
        assert dep["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
