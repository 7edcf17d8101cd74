"""Settings from the environment (and a ``.env`` file), with defaults that need no server."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from .errors import ConfigurationError

__all__ = ["MAKE_SECRET", "MIN_SECRET_BYTES", "FromEnvironment", "Settings",
           "embedded_broker_url", "embedded_database_url", "metrics_exposure_problem"]

#: the shortest approval secret accepted: an HMAC-SHA256 key worth its 256 bits
MIN_SECRET_BYTES = 32
#: how long a ``.env`` that is a named pipe may keep a process waiting for its writer
DOTENV_PIPE_WAIT = 10.0
MAKE_SECRET = ('Make one with: python -c "import secrets; '
               'print(secrets.token_urlsafe(32))"')


def embedded_database_url() -> str:
    """A SQLite journal in the working directory."""
    return f"sqlite:///{Path(os.getcwd()) / 'sagaworker.db'}"


def embedded_broker_url() -> str:
    """kombu's filesystem transport: works across processes, needs no server."""
    return "filesystem://"


def metrics_exposure_problem(addr: str, has_token: bool) -> str | None:
    """Why serving metrics on ``addr`` is refused (the network without a token), or None:
    the figures name every tool and count every saga, and anyone could scrape them."""
    try:
        loopback = addr == "localhost" or ipaddress.ip_address(addr).is_loopback
    except ValueError:
        loopback = False
    if loopback or has_token:
        return None
    return (f"SAGAWORKER_METRICS_ADDR={addr} would serve the journal's metrics to the network "
            "without authentication: set SAGAWORKER_METRICS_TOKEN (scrapers send it as "
            "Authorization: Bearer; Prometheus: authorization: {credentials: ...}) or keep "
            "SAGAWORKER_METRICS_ADDR=127.0.0.1")


def environment(prefix: str, fields: Any) -> dict[str, str]:
    """``prefix + FIELD`` variables (any case) of the process's environment, over those of
    a ``.env`` file in the working directory (a regular file or a named pipe), keyed by
    field."""
    wanted = {f"{prefix}{name}".upper(): name for name in fields}
    found: dict[str, str] = {}
    dotenv = Path(".env")
    if dotenv.is_file() or dotenv.is_fifo():
        from io import StringIO

        from dotenv import dotenv_values

        try:  # read here: python-dotenv before 1.2.1 skips what is not a regular file
            # literally: a ${VAR} in a line is text, never another variable's value
            values = dotenv_values(stream=StringIO(_dotenv_text(dotenv)), interpolate=False)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(
                f"{dotenv.resolve()} cannot be read ({type(exc).__name__}: {exc}); fix or "
                "remove it (it must be UTF-8 text of NAME=value lines)") from None
        found.update((wanted[k.upper()], v) for k, v in values.items()
                     if k.upper() in wanted and v is not None)
    found.update((wanted[k.upper()], v) for k, v in os.environ.items() if k.upper() in wanted)
    return found


def _dotenv_text(path: Path) -> str:
    """The text of ``.env``; a named pipe is read by a thread, waited for at most
    ``DOTENV_PIPE_WAIT`` seconds: its open() blocks until a writer comes, and with no
    writer (the secret manager not running) every process would hang, saying nothing."""
    if not path.is_fifo():
        return path.read_text(encoding="utf-8")
    import threading

    got: list[str | BaseException] = []

    def read() -> None:
        try:
            got.append(path.read_text(encoding="utf-8"))
        except BaseException as exc:  # handed to the caller
            got.append(exc)

    # a daemon: left blocked in open() when no writer comes, it never holds up an exit
    reader = threading.Thread(target=read, name="sagaworker-dotenv", daemon=True)
    reader.start()
    reader.join(DOTENV_PIPE_WAIT)
    if not got:
        raise ConfigurationError(
            f"{path.resolve()} is a named pipe that no process wrote within "
            f"{DOTENV_PIPE_WAIT:g} s: start what writes it (your secret manager's run "
            "command), or remove it and set SAGAWORKER_* in the environment")
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]


class FromEnvironment(BaseModel):
    """A frozen model whose fields not passed in come from the environment, then from a
    ``.env`` file, then from their defaults (pydantic-settings' order, without its
    imports in every worker process)."""

    model_config = ConfigDict(extra="ignore", frozen=True, validate_default=True,
                              # a rejected value (a short secret, a URL with a password)
                              # is not echoed back
                              hide_input_in_errors=True,
                              # a setting may start with "model_" (SAGAWORKER_MODEL_RETRIES)
                              protected_namespaces=())
    env_prefix: ClassVar[str] = "SAGAWORKER_"

    @model_validator(mode="before")
    @classmethod
    def _environment(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        options = sorted(k for k in data if isinstance(k, str) and k.startswith("_"))
        if options:
            raise TypeError(
                f"{cls.__name__}() takes no {', '.join(options)}: it reads "
                f"{cls.env_prefix}* from the environment, then from .env in the working "
                "directory; pass the settings themselves as arguments instead")
        # a setting's name in any case, as in the environment
        given = {k.lower() if isinstance(k, str) and k.lower() in cls.model_fields else k: v
                 for k, v in data.items()}
        return {**environment(cls.env_prefix, cls.model_fields), **given}


class Settings(FromEnvironment):
    """Every ``SAGAWORKER_*`` variable. Unknown variables are ignored."""

    database_url: str = Field(default_factory=embedded_database_url)
    broker_url: str = Field(default_factory=embedded_broker_url)
    #: the HMAC key of approval tokens; a SecretStr, so no repr, log or traceback shows it
    approval_secret: SecretStr | None = None
    log_format: Literal["json", "console"] = "json"
    log_level: str = "INFO"
    compensation_retries: int = Field(default=3, ge=0)
    #: first backoff between undo tries, doubled each try, capped at 60 s
    compensation_backoff: float = Field(default=1.0, ge=0)
    orphan_after: float = Field(default=300, gt=0)
    approval_ttl: float = Field(default=86400, gt=0)
    redeliver_after: float = Field(default=60, gt=0)
    #: the module holding the Celery app and its Sagaworker, for the CLI (no default: a
    #: command never guesses, so it never reads or migrates another app's journal)
    app: str | None = None
    #: re-runs of an idempotent step whose attempt died, before it ends FAILED in doubt
    max_reruns: int = Field(default=3, ge=0)
    #: tries in all of an agent's model request that fails for a passing reason (a rate
    #: limit, a 5xx, a timeout), backing off between them, before the run fails
    model_retries: int = Field(default=5, ge=1)
    #: how long an agent's model request in flight is presumed alive without a heartbeat
    #: (its worker beats three times a lease): a killed worker's run is resumed by another
    #: within about twice this (a tool step's claim keeps SAGAWORKER_REDELIVER_AFTER)
    unit_lease: float = Field(default=5, gt=0)
    #: seconds before an undriven RUNNING saga of the asynchronous form is reported
    idle_after: float = Field(default=3600, gt=0)
    #: seconds between the sweeper's replays of a flow held on a divergence
    diverged_retry: float = Field(default=600, gt=0)
    redact: str = ""
    #: comma-separated Fernet keys: the journal's arguments, results and metadata are
    #: encrypted with the first, decrypted with any (docs/encryption.md); None: clear
    encryption_keys: SecretStr | None = None
    #: the queue of sagaworker's own work (failure handling, compensation, sweeps)
    queue: str = "sagaworker"
    #: largest JSON-encoded arguments a step may carry, in bytes
    max_args_bytes: int = Field(default=256 * 1024, gt=0)
    #: largest JSON-encoded result a step, a durable unit (a model's answer) or a flow's
    #: return value may journal, in bytes (every reader of the journal is served it)
    max_result_bytes: int = Field(default=1024 * 1024, gt=0)
    #: how long an INTENT may stay unstarted before the relay publishes it again
    relay_after: float = Field(default=30, gt=0)
    #: a worker that advances a flow runs the flow's next step itself when it can (no
    #: broker round trip, journaled the same); False: every step is published
    eager_steps: bool = True
    #: how often every worker runs the sweeper on its own timer (0 disables it)
    sweep_interval: float = Field(default=15, ge=0)
    #: Prometheus metrics port a worker serves (0: off)
    metrics_port: int = Field(default=0, ge=0, le=65535)
    #: the address the metrics server binds: loopback unless told (any other needs a token)
    metrics_addr: str = "127.0.0.1"
    #: the bearer token every scrape must send (None: none asked, loopback only)
    metrics_token: SecretStr | None = None
    #: beat prunes terminal sagas older than this many days, daily (None: never)
    retention_days: int | None = Field(default=None, gt=0)
    #: the dashboard links each step of a saga's timeline to its trace: a URL with
    #: ``{trace_id}`` (``https://tempo.example/trace/{trace_id}``); None: no links
    trace_url: str | None = None
    #: filesystem broker folder (embedded default only)
    broker_folder: str = ".sagaworker/broker"
    #: ``sagaworker mcp --http``: the clients' bearer tokens, comma-separated
    #: ``name:sha256hex`` pairs as SAGAWORKER_WEB_TOKENS (empty: loopback only, no tokens)
    mcp_tokens: str = ""

    @field_validator("trace_url")
    @classmethod
    def _trace_url(cls, v: str | None) -> str | None:
        if v and "{trace_id}" not in v:
            raise ValueError("SAGAWORKER_TRACE_URL must hold {trace_id} where the trace's id "
                             "goes, e.g. https://tempo.example/trace/{trace_id}")
        return v or None

    @field_validator("approval_secret", mode="before")
    @classmethod
    def _secret(cls, v: Any) -> Any:
        raw = v.get_secret_value() if isinstance(v, SecretStr) else v
        if raw is None or raw == "":
            return None  # unset (an empty SAGAWORKER_APPROVAL_SECRET= line included)
        # a short secret is kept, not refused here: refused in one line where it would be
        # used (a worker with gated tools refuses to start; approvals refuse to sign)
        return v

    @property
    def approval_secret_problem(self) -> str | None:
        """Why approvals cannot work with this secret (unset, too short), or None."""
        if self.approval_secret is None:
            return ("SAGAWORKER_APPROVAL_SECRET is unset; approvals need it (the same value "
                    f"on producers, workers and wherever approvals are decided). {MAKE_SECRET}")
        # several, comma-separated, while one is rotated: the first signs, all verify
        parts = [p.strip() for p in self.approval_secret.get_secret_value().split(",")]
        if not any(parts):
            return ("SAGAWORKER_APPROVAL_SECRET holds only spaces; an approval secret needs "
                    f"at least {MIN_SECRET_BYTES} random bytes. {MAKE_SECRET}")
        for i, part in enumerate(p for p in parts if p):
            n = len(part.encode())
            if n < MIN_SECRET_BYTES:
                which = f" (its secret #{i + 1})" if len(parts) > 1 else ""
                return (f"SAGAWORKER_APPROVAL_SECRET{which} is {n} bytes; an approval secret "
                        f"needs at least {MIN_SECRET_BYTES} random bytes. {MAKE_SECRET}")
        return None

    @field_validator("encryption_keys", mode="before")
    @classmethod
    def _keys(cls, v: Any) -> Any:
        raw = v.get_secret_value() if isinstance(v, SecretStr) else v
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            return None  # unset: the journal is written in clear
        if isinstance(raw, str):
            from .crypto import parse_keys

            parse_keys(raw)  # ConfigurationError saying how to make a key
        return v

    @property
    def metrics_problem(self) -> str | None:
        """Why the metrics this worker would serve are refused, or None (or off)."""
        if not self.metrics_port:
            return None
        return metrics_exposure_problem(self.metrics_addr, self.metrics_token is not None)

    @field_validator("retention_days", "metrics_token", mode="before")
    @classmethod
    def _unset_when_empty(cls, v: Any) -> Any:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("log_level")
    @classmethod
    def _upper(cls, v: str) -> str:
        return v.upper()

    @property
    def redact_keys(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.redact.split(",") if k.strip())

    @property
    def lease_seconds(self) -> float:
        """How long a started attempt or undo is presumed alive without a heartbeat."""
        return self.redeliver_after
