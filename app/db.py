"""The console's one SQLite file: the engine, forward-only schema migrations, a session per request, and the write
transactions of the threads beside the request handlers (runs, switches, the supervisor, the watch).

Migrations are frozen SQL, not `metadata.create_all()`: the models describe the newest schema, and an old database
must reach it step by step with its rows intact. `tests/console/test_db.py` checks that the models and the migrated
schema agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import structlog
from sqlalchemy import Connection, DateTime, Engine, TypeDecorator, create_engine, event
from sqlmodel import Session

log = structlog.get_logger(__name__)


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """SQLite keeps no time zone: store UTC, and read it back as an aware datetime."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        return None if value is None else value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: Sequence[str]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "operators, tokens, profiles, evidence, audit",
        (
            """CREATE TABLE secret (
                name TEXT PRIMARY KEY,
                value TEXT NOT NULL,
                created_at TIMESTAMP NOT NULL)""",
            """CREATE TABLE operator (
                id INTEGER PRIMARY KEY,
                name TEXT NOT NULL UNIQUE,
                role TEXT NOT NULL CHECK (role IN ('viewer', 'operator', 'admin')),
                created_at TIMESTAMP NOT NULL,
                created_by TEXT NOT NULL)""",
            """CREATE TABLE token (
                id INTEGER PRIMARY KEY,
                operator_id INTEGER NOT NULL REFERENCES operator (id),
                name TEXT NOT NULL,
                kind TEXT NOT NULL CHECK (kind IN ('api', 'session')),
                token_sha256 TEXT NOT NULL UNIQUE,
                created_at TIMESTAMP NOT NULL,
                expires_at TIMESTAMP,
                revoked_at TIMESTAMP)""",
            "CREATE INDEX ix_token_operator_id ON token (operator_id)",
            """CREATE TABLE profile (
                id INTEGER PRIMARY KEY,
                name TEXT NOT NULL UNIQUE,
                parent_id INTEGER REFERENCES profile (id),
                rationale TEXT NOT NULL,
                model TEXT NOT NULL,
                revision TEXT,
                dtype TEXT NOT NULL,
                context_length INTEGER NOT NULL,
                max_num_batched_tokens INTEGER NOT NULL,
                max_num_seqs INTEGER NOT NULL,
                gpu_memory_utilization FLOAT NOT NULL,
                kv_cache_dtype TEXT NOT NULL,
                cuda_graph_max_bs INTEGER NOT NULL,
                tensor_parallel_size INTEGER NOT NULL,
                max_output_tokens INTEGER NOT NULL,
                engine_extras JSON NOT NULL,
                content_hash TEXT NOT NULL,
                created_at TIMESTAMP NOT NULL,
                created_by TEXT NOT NULL,
                retired BOOLEAN NOT NULL,
                retired_at TIMESTAMP,
                retired_by TEXT)""",
            "CREATE INDEX ix_profile_parent_id ON profile (parent_id)",
            """CREATE TABLE evidence (
                id INTEGER PRIMARY KEY,
                profile_id INTEGER NOT NULL REFERENCES profile (id),
                gate TEXT NOT NULL,
                created_at TIMESTAMP NOT NULL,
                payload JSON NOT NULL)""",
            "CREATE INDEX ix_evidence_profile_id ON evidence (profile_id)",
            """CREATE TABLE audit (
                id INTEGER PRIMARY KEY,
                at TIMESTAMP NOT NULL,
                actor TEXT NOT NULL,
                action TEXT NOT NULL,
                target TEXT NOT NULL,
                before JSON,
                after JSON,
                request_id TEXT)""",
            "CREATE INDEX ix_audit_target ON audit (target)",
        ),
    ),
    Migration(
        2,
        "engine runs",
        (
            """CREATE TABLE engine_run (
                id INTEGER PRIMARY KEY,
                profile_id INTEGER NOT NULL REFERENCES profile (id),
                content_hash TEXT NOT NULL,
                weights_fingerprint TEXT NOT NULL,
                driver TEXT NOT NULL CHECK (driver IN ('process', 'docker')),
                state TEXT NOT NULL
                    CHECK (state IN ('starting', 'ready', 'stopping', 'stopped', 'crashed', 'failed')),
                command JSON NOT NULL,
                preflight JSON NOT NULL,
                started_at TIMESTAMP NOT NULL,
                started_by TEXT NOT NULL,
                ready_at TIMESTAMP,
                stopped_at TIMESTAMP,
                stopped_by TEXT,
                exit_code INTEGER,
                pid INTEGER,
                container TEXT,
                log_path TEXT NOT NULL,
                boot_stages JSON NOT NULL,
                load_progress JSON,
                ready_line JSON,
                server_info JSON,
                last_error TEXT,
                last_lines JSON NOT NULL,
                gpu_release JSON)""",
            "CREATE INDEX ix_engine_run_profile_id ON engine_run (profile_id)",
            "CREATE INDEX ix_engine_run_state ON engine_run (state)",
        ),
    ),
    Migration(
        3,
        "qualification runs, gate results, decisions, waivers, route, promotions",
        (
            """CREATE TABLE qualification_run (
                id INTEGER PRIMARY KEY,
                profile_id INTEGER NOT NULL REFERENCES profile (id),
                content_hash TEXT NOT NULL,
                weights_fingerprint TEXT,
                engine_build TEXT,
                engine_run_id INTEGER REFERENCES engine_run (id),
                ladder TEXT NOT NULL,
                scale TEXT CHECK (scale IN ('full', 'demo')),
                status TEXT NOT NULL
                    CHECK (status IN ('waiting', 'starting', 'running', 'passed', 'failed', 'aborted')),
                progress JSON NOT NULL,
                started_at TIMESTAMP NOT NULL,
                started_by TEXT NOT NULL,
                finished_at TIMESTAMP,
                stop_reason TEXT,
                disruption JSON)""",
            "CREATE INDEX ix_qualification_run_profile_id ON qualification_run (profile_id)",
            """CREATE TABLE gate_result (
                id INTEGER PRIMARY KEY,
                run_id INTEGER NOT NULL REFERENCES qualification_run (id),
                position INTEGER NOT NULL,
                gate TEXT NOT NULL,
                version INTEGER NOT NULL,
                status TEXT NOT NULL
                    CHECK (status IN ('pending', 'running', 'passed', 'failed', 'n/a', 'not_run')),
                summary TEXT NOT NULL,
                inputs JSON NOT NULL,
                measurements JSON NOT NULL,
                started_at TIMESTAMP,
                finished_at TIMESTAMP,
                UNIQUE (run_id, gate))""",
            "CREATE INDEX ix_gate_result_run_id ON gate_result (run_id)",
            "ALTER TABLE evidence ADD COLUMN run_id INTEGER REFERENCES qualification_run (id)",
            "CREATE INDEX ix_evidence_run_id ON evidence (run_id)",
            """CREATE TABLE decision (
                id INTEGER PRIMARY KEY,
                profile_id INTEGER NOT NULL REFERENCES profile (id),
                run_id INTEGER NOT NULL REFERENCES qualification_run (id),
                decision TEXT NOT NULL CHECK (decision IN ('promote', 'no_promotion', 'reject')),
                reason TEXT NOT NULL,
                operator TEXT NOT NULL,
                content_hash TEXT NOT NULL,
                created_at TIMESTAMP NOT NULL)""",
            "CREATE INDEX ix_decision_profile_id ON decision (profile_id)",
            """CREATE TABLE waiver (
                id INTEGER PRIMARY KEY,
                decision_id INTEGER NOT NULL REFERENCES decision (id),
                gate TEXT NOT NULL,
                reason TEXT NOT NULL,
                operator TEXT NOT NULL,
                created_at TIMESTAMP NOT NULL)""",
            "CREATE INDEX ix_waiver_decision_id ON waiver (decision_id)",
            """CREATE TABLE route (
                alias TEXT PRIMARY KEY,
                production_id INTEGER REFERENCES profile (id),
                rollback_id INTEGER REFERENCES profile (id),
                updated_at TIMESTAMP NOT NULL,
                updated_by TEXT NOT NULL)""",
            """CREATE TABLE promotion (
                id INTEGER PRIMARY KEY,
                kind TEXT NOT NULL CHECK (kind IN ('promote', 'rollback')),
                target_id INTEGER NOT NULL REFERENCES profile (id),
                previous_id INTEGER REFERENCES profile (id),
                restore_id INTEGER REFERENCES profile (id),
                decision_id INTEGER REFERENCES decision (id),
                reason TEXT NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('running', 'committed', 'rolled_back', 'failed')),
                steps JSON NOT NULL,
                started_at TIMESTAMP NOT NULL,
                started_by TEXT NOT NULL,
                finished_at TIMESTAMP,
                downtime_s FLOAT,
                error TEXT)""",
        ),
    ),
    Migration(
        4,
        "agent keys, route usage, alerts",
        (
            """CREATE TABLE agent_key (
                id INTEGER PRIMARY KEY,
                name TEXT NOT NULL,
                key_sha256 TEXT NOT NULL UNIQUE,
                created_at TIMESTAMP NOT NULL,
                created_by TEXT NOT NULL,
                last_used_at TIMESTAMP,
                revoked_at TIMESTAMP,
                revoked_by TEXT)""",
            # A revoked key keeps its name in the record; a new key may take the name again.
            "CREATE UNIQUE INDEX ux_agent_key_live_name ON agent_key (name) WHERE revoked_at IS NULL",
            """CREATE TABLE route_usage (
                id INTEGER PRIMARY KEY,
                key_id INTEGER REFERENCES agent_key (id),
                caller TEXT NOT NULL,
                profile TEXT NOT NULL,
                requests INTEGER NOT NULL,
                errors INTEGER NOT NULL,
                latency_sum_s FLOAT NOT NULL,
                latency_max_s FLOAT NOT NULL,
                latency_buckets JSON NOT NULL,
                last_at TIMESTAMP NOT NULL)""",
            "CREATE INDEX ix_route_usage_key_id ON route_usage (key_id)",
            """CREATE TABLE alert (
                id INTEGER PRIMARY KEY,
                at TIMESTAMP NOT NULL,
                level TEXT NOT NULL CHECK (level IN ('warning', 'error')),
                profile TEXT,
                message TEXT NOT NULL,
                acknowledged_at TIMESTAMP,
                acknowledged_by TEXT)""",
        ),
    ),
    Migration(
        5,
        "engine runs an operator stopped",
        ("ALTER TABLE engine_run ADD COLUMN keep_stopped BOOLEAN NOT NULL DEFAULT 0",),
    ),
    Migration(
        6,
        "one engine over several GPUs: a profile's attention mode and GPUs, a run's environment",
        (
            # Every profile before this ran with the engine's default attention and the console's GPUs.
            "ALTER TABLE profile ADD COLUMN attention TEXT NOT NULL DEFAULT 'data-parallel'",
            "ALTER TABLE profile ADD COLUMN gpus JSON",
            # What the engine's environment got from the profile (CUDA_VISIBLE_DEVICES), beside its command line.
            "ALTER TABLE engine_run ADD COLUMN environment JSON NOT NULL DEFAULT '{}'",
        ),
    ),
)

SCHEMA_VERSION_DDL = """CREATE TABLE IF NOT EXISTS schema_version (
    version INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    applied_at TIMESTAMP NOT NULL)"""


def create_db_engine(path: Path) -> Engine:
    """An engine whose connections use WAL, enforce foreign keys, and wrap DDL in real transactions."""
    engine = create_engine(f"sqlite:///{path}", connect_args={"check_same_thread": False, "timeout": 5})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        # pysqlite otherwise opens transactions itself and commits before DDL; SQLAlchemy's "begin" hook does it.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=5000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN")

    return engine


def schema_version(engine: Engine) -> int:
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA_VERSION_DDL)
        return conn.exec_driver_sql("SELECT coalesce(max(version), 0) FROM schema_version").scalar_one()


def migrate(engine: Engine, migrations: Sequence[Migration] = MIGRATIONS) -> int:
    """Apply every migration newer than the database, each in its own transaction; return the version reached."""
    current = schema_version(engine)
    known = max((m.version for m in migrations), default=0)
    if current > known:
        raise RuntimeError(f"database schema version {current} is newer than this console knows ({known})")
    for migration in sorted(migrations, key=lambda m: m.version):
        if migration.version <= current:
            continue
        with engine.begin() as conn:
            for statement in migration.statements:
                conn.exec_driver_sql(statement)
            conn.exec_driver_sql(
                "INSERT INTO schema_version (version, name, applied_at) VALUES (?, ?, ?)",
                (migration.version, migration.name, utcnow().replace(tzinfo=None).isoformat(" ")),
            )
        log.info("schema_migrated", version=migration.version, name=migration.name)
        current = migration.version
    return current


def session_provider(engine: Engine) -> Callable[[], Iterator[Session]]:
    """A Litestar dependency: one session per request, closed (and rolled back if unfinished) afterwards."""

    def provide_db_session() -> Iterator[Session]:
        with Session(engine, expire_on_commit=False) as session:
            yield session

    return provide_db_session


# A write that changes nothing: SQLite takes the write lock for any UPDATE, matched rows or not.
TAKE_WRITE_LOCK = "UPDATE schema_version SET version = version WHERE 0"


@contextmanager
def writing(db: Engine) -> Iterator[Session]:
    """A write transaction that takes the write lock with its first statement. In WAL mode SQLite fails a
    transaction at once with "database is locked" when it read before its first write and another connection
    committed in between (SQLITE_BUSY_SNAPSHOT, which no busy timeout waits out); one that locks first waits for the
    lock instead (busy_timeout), then reads fresh rows."""
    with Session(db) as session:
        lock_for_write(session)
        yield session


def lock_for_write(session: Session) -> None:
    """Begin `session`'s transaction with the write lock (see `writing`): for a request's own session that reads,
    then writes."""
    session.connection().exec_driver_sql(TAKE_WRITE_LOCK)
