"""Is the journal ready? Named in one line at start, never as a raw SQL error later: the
database cannot be reached (its URL shown with the password masked), or the journal's
schema is missing or older than the code (`sagaworker db upgrade`)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import cast

from sqlalchemy import JSON, Connection, Engine, delete, insert, inspect, select, text, type_coerce
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError

from .._base.crypto import Cipher, is_sealed
from .._base.errors import ConfigurationError, JournalUnavailable
from .dialect import POOLED
from .schema import facts, sagas
from .urls import masked, scrubbed

__all__ = ["check_approval_secrets", "check_journal", "check_keys", "keys_changed", "masked",
           "unreachable"]

VERSION_TABLE = "sagaworker_alembic_version"
_KEY = "key:"  # a fact naming a key values are sealed with
_APPROVAL = "approval:"  # a fact naming an approval secret's fingerprint
#: a fact: every value of the journal is sealed for its place (a token sealed before
#: places were is refused from then on: it can only have been copied there)
_PLACED = "values placed"


def unreachable(url: str, exc: BaseException) -> JournalUnavailable:
    """The one-line refusal for a journal database that cannot be reached (no piece of
    its password in it, nor in the driver's error it quotes)."""
    orig = getattr(exc, "orig", None) or exc
    first = scrubbed((str(orig).strip().splitlines() or [type(orig).__name__])[0], url)
    return JournalUnavailable(
        f"cannot reach the journal database {masked(url)} ({first[:200]}); check "
        "SAGAWORKER_DATABASE_URL (or the database_url your Sagaworker is given) and that "
        "the server accepts connections")


_REVISION = re.compile(r"^revision: str = '([^']+)'", re.M)
_DOWN = re.compile(r"^down_revision: [^=]+= (?:'([^']+)'|None)", re.M)


@functools.cache
def _revisions() -> tuple[str, list[str]]:
    """The code's head revision and every revision it knows, oldest first: read from the
    migration files' headers (one linear history; a test holds it to Alembic's own
    view), so a worker's start never imports Alembic (megabytes in every process)."""
    after: dict[str | None, str] = {}
    files = list((Path(__file__).parent / "migrations" / "versions").glob("*.py"))
    for path in files:
        text = path.read_text(encoding="utf-8")
        rev, down = _REVISION.search(text), _DOWN.search(text)
        if rev is not None and down is not None:
            after[down.group(1)] = rev.group(1)
    known, rev_ = [], after.get(None)
    while rev_ is not None:
        known.append(rev_)
        rev_ = after.get(rev_)
    migrations = [f for f in files if f.name != "__init__.py"]
    if not known or len(known) != len(migrations):  # no sources, or not one plain history
        return _alembic_revisions()
    return known[-1], known


def _alembic_revisions() -> tuple[str, list[str]]:
    """What Alembic itself reads of the migrations (the slow path: it imports Alembic)."""
    from alembic.script import ScriptDirectory

    from .migrate import alembic_config

    try:
        script = ScriptDirectory.from_config(alembic_config("sqlite://"))
        head = script.get_current_head()
        known = [r.revision for r in script.walk_revisions()][::-1]
    except Exception as exc:
        raise ConfigurationError(
            "sagaworker's migration files cannot be read from its install "
            f"({type(exc).__name__}: {exc}); reinstall sagaworker from its wheel, which "
            "ships them as sources") from exc
    if head is None:
        raise ConfigurationError(
            "sagaworker's migration files are missing from its install; reinstall "
            "sagaworker from its wheel, which ships them as sources")
    return head, known


def pooled(url: str) -> str:
    return (f"the journal {masked(url)} is reached through a connection pooler (its server "
            "process is not the one the connection was given): after a lost connection the "
            "journal waits for, and may stop, the statement's server process before it "
            "trusts what the data says, which a pooler hides and hands to other clients; "
            "point SAGAWORKER_DATABASE_URL at PostgreSQL itself (docs/scaling.md)")


def check_journal(engine: Engine, url: str, *, made_here: bool = False) -> None:
    """Raise ConfigurationError, in one line that names the fix, unless the journal on
    ``engine`` can be reached and its schema is the code's (or newer). ``made_here``: the
    embedded SQLite journal, whose tables this process makes itself (no revision unless
    someone migrated it)."""
    try:
        with engine.connect() as conn:
            if conn.connection.info.get(POOLED):
                raise JournalUnavailable(pooled(url))
            if not inspect(conn).has_table(VERSION_TABLE):
                if made_here:
                    return
                raise JournalUnavailable(
                    f"the journal's tables are missing in {masked(url)}: run `sagaworker -A "
                    "MODULE db upgrade` (the release step) before starting workers or "
                    "producers")
            version = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
    except (DBAPIError, SQLAlchemyError) as exc:
        if isinstance(exc, DBAPIError) and not exc.connection_invalidated and \
                not _is_connect_error(exc):
            first = scrubbed(str(getattr(exc, "orig", exc)).splitlines()[0], url)
            raise JournalUnavailable(
                f"cannot read the journal's schema version in {masked(url)} "
                f"({first[:200]}); run `sagaworker -A MODULE db upgrade`") from None
        raise unreachable(url, exc) from None
    head, known = _revisions()
    if version in known and known.index(str(version)) < known.index(head):
        raise JournalUnavailable(
            f"the journal's schema in {masked(url)} is at revision {version}, older than "
            f"this code's {head}: run `sagaworker -A MODULE db upgrade`")
    if version is None:
        raise JournalUnavailable(
            f"the journal's schema in {masked(url)} has no revision: run `sagaworker -A "
            "MODULE db upgrade`")


def check_keys(engine: Engine, cipher: Cipher | None) -> None:
    """Refuse a process that could not read the journal's values: the journal names every
    key its values are sealed with (``sagaworker_facts``, by fingerprint); a process that
    holds no key, or not all of those, would write values in clear or under a key nobody
    else has, and fail every reader after it. A process with keys records its sealing
    key's fingerprint."""
    mine = cipher.fingerprints if cipher is not None else []
    with engine.begin() as conn:
        sealed = {n[len(_KEY):] for n in conn.execute(
            select(facts.c.name).where(facts.c.name.like(f"{_KEY}%"))).scalars()}
        missing = sorted(sealed - set(mine))
        if missing and not mine:
            raise ConfigurationError(
                f"the journal's values are sealed with a key (fingerprint {', '.join(missing)})"
                " and this process holds no key: set SAGAWORKER_ENCRYPTION_KEYS to the "
                "journal's keys (docs/encryption.md)")
        if missing:
            raise ConfigurationError(
                f"SAGAWORKER_ENCRYPTION_KEYS holds no key the journal's values are sealed "
                f"with (fingerprint {', '.join(missing)}; this process holds "
                f"{', '.join(mine)}): list that key too, after the current first one")
        if not sealed or (mine and mine[0] not in sealed):
            # the journal names no key yet (upgraded from a release before the names), or
            # a new one would be named: a value it holds sealed must open with our keys
            _opens_a_sample(conn, cipher)
        if mine and mine[0] not in sealed:
            _note(conn, _KEY + mine[0], "seals")
        # (never recorded here, even for a new journal: a process of an earlier release,
        # still running beside this one, writes tokens without places)
        _placed_only(conn, cipher)


def _note(conn: Connection, name: str, value: str) -> None:
    """A fact recorded (unless another process recorded it a moment ago)."""
    try:
        with conn.begin_nested():
            conn.execute(insert(facts).values(name=name, value=value))
    except IntegrityError:
        pass


def _placed_only(conn: Connection, cipher: Cipher | None) -> None:
    """``cipher`` refuses tokens sealed before places once the journal says none is left."""
    if cipher is not None:
        cipher.placed_only = conn.execute(
            select(facts.c.name).where(facts.c.name == _PLACED)).first() is not None


def keys_changed(engine: Engine, cipher: Cipher | None) -> str | None:
    """What a running process must stop for: the journal names a key (its values are
    sealed with it now) that this process does not hold. A worker started before
    encryption was turned on would otherwise go on writing results in clear, or under
    a key nobody else has. One small read (``check_keys`` does the rest at start)."""
    mine = set(cipher.fingerprints if cipher is not None else [])
    with engine.connect() as conn:
        names = set(conn.execute(select(facts.c.name).where(
            facts.c.name.like(f"{_KEY}%") | (facts.c.name == _PLACED))).scalars())
    sealed = {n[len(_KEY):] for n in names if n.startswith(_KEY)}
    if cipher is not None:
        cipher.placed_only = _PLACED in names
    if not sealed or sealed & mine:
        return None
    return (f"the journal's values are now sealed with a key (fingerprint "
            f"{', '.join(sorted(sealed))}) this process does not hold: it stops rather than "
            "write values in clear; restart it with SAGAWORKER_ENCRYPTION_KEYS "
            "(docs/encryption.md)")


def check_approval_secrets(engine: Engine, fingerprints: list[str]) -> None:
    """Refuse a process whose approval secret is not the one this journal's approvals are
    made with: the journal records the fingerprints of the secrets that sign (a process
    approving with another secret would hand out tokens no other process accepts, and
    its approvals would run on workers that never checked them against their secret). A
    process holding one of them (the others listed after it, while rotating) records the
    first."""
    with engine.begin() as conn:
        known = set(conn.execute(select(facts.c.name).where(
            facts.c.name.like(f"{_APPROVAL}%"))).scalars())
        known = {n[len(_APPROVAL):] for n in known}
        if known and not known & set(fingerprints):
            raise ConfigurationError(
                "SAGAWORKER_APPROVAL_SECRET is not the secret this journal's approvals are "
                f"made with (fingerprint {', '.join(sorted(known))}; this process holds "
                f"{', '.join(fingerprints)}): set the same secret on producers, workers and "
                "wherever approvals are decided; to rotate it, list the new secret first and "
                "the old one after it, comma-separated, everywhere")
        if fingerprints[0] not in known:
            try:
                with conn.begin_nested():
                    conn.execute(insert(facts).values(name=_APPROVAL + fingerprints[0],
                                                      value="signs approvals"))
            except IntegrityError:
                pass  # another process recorded it a moment ago


def _opens_a_sample(conn: Connection, cipher: Cipher | None) -> None:
    """Refuse unless the newest sealed metadata among the last sagas opens with ``cipher``
    (a process never names a key the journal was not written with)."""
    raw = type_coerce(sagas.c.metadata, JSON().with_variant(JSONB(), "postgresql"))
    for value in conn.execute(select(raw).order_by(sagas.c.created_at.desc())
                              .limit(20)).scalars():
        if is_sealed(value):
            if cipher is None:
                raise ConfigurationError(
                    "the journal's values are sealed with a key and this process holds no "
                    "key: set SAGAWORKER_ENCRYPTION_KEYS to the journal's keys "
                    "(docs/encryption.md)")
            cipher.open(cast(dict[str, str], value), "the journal's newest sealed metadata",
                        None)
            return


def forget_keys(conn: Connection, cipher: Cipher) -> None:
    """Every value is sealed with the first key for its place now (``db rotate-key``
    finished): the journal names that key only, and says so of places."""
    conn.execute(delete(facts).where(facts.c.name.like(f"{_KEY}%"),
                                     facts.c.name != _KEY + cipher.fingerprints[0]))
    _note(conn, _PLACED, "by rotate-key")
    _placed_only(conn, cipher)


def _is_connect_error(exc: DBAPIError) -> bool:
    from sqlalchemy.exc import InterfaceError, OperationalError

    return isinstance(exc, OperationalError | InterfaceError)
