"""The database file: WAL, foreign keys, a recorded schema version, forward migrations that keep rows, and a schema
that matches the models."""

from __future__ import annotations

import sqlite3

import pytest
from litestar.testing import TestClient
from sqlalchemy import inspect
from sqlmodel import SQLModel

from app.db import MIGRATIONS, Migration, create_db_engine, migrate, schema_version


def test_schema_version_wal_and_foreign_keys(client, data_dir):
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        versions = conn.execute("SELECT version, name FROM schema_version").fetchall()
        journal = conn.execute("PRAGMA journal_mode").fetchone()[0]
    assert versions == [(m.version, m.name) for m in MIGRATIONS]
    assert journal == "wal"
    engine = create_db_engine(data_dir / "flashgate.sqlite3")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar_one() == 1
        with pytest.raises(Exception, match="FOREIGN KEY"):
            conn.exec_driver_sql(
                "INSERT INTO evidence (profile_id, gate, created_at, payload) VALUES (9999, 'g', '2025-01-01', '{}')"
            )


def test_models_match_the_migrated_schema(client, data_dir):
    engine = create_db_engine(data_dir / "flashgate.sqlite3")
    inspector = inspect(engine)
    for table in SQLModel.metadata.sorted_tables:
        columns = {c["name"]: c for c in inspector.get_columns(table.name)}
        assert set(columns) == {c.name for c in table.columns}, table.name
        for column in table.columns:
            if not column.primary_key:  # SQLite reports an INTEGER PRIMARY KEY as nullable
                assert columns[column.name]["nullable"] == column.nullable, f"{table.name}.{column.name}"


def test_a_forward_migration_keeps_the_rows(tmp_path):
    engine = create_db_engine(tmp_path / "db.sqlite3")
    assert migrate(engine) == MIGRATIONS[-1].version
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO operator (name, role, created_at, created_by) VALUES ('ada', 'admin', '2025-01-01', 'test')"
        )
    upgrade = Migration(
        MIGRATIONS[-1].version + 1, "operator email", ["ALTER TABLE operator ADD COLUMN email TEXT NOT NULL DEFAULT ''"]
    )
    assert migrate(engine, [*MIGRATIONS, upgrade]) == upgrade.version
    assert migrate(engine, [*MIGRATIONS, upgrade]) == upgrade.version  # a second start applies nothing
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT name, role, email FROM operator").all() == [("ada", "admin", "")]
        assert conn.exec_driver_sql("SELECT count(*) FROM schema_version").scalar_one() == upgrade.version
    # An older console refuses a newer database instead of guessing.
    with pytest.raises(RuntimeError, match="newer than this console knows"):
        migrate(engine)


def test_a_failed_migration_leaves_the_database_as_it_was(tmp_path):
    engine = create_db_engine(tmp_path / "db.sqlite3")
    migrate(engine)
    broken = Migration(MIGRATIONS[-1].version + 1, "broken", ["CREATE TABLE half (id INTEGER)", "NOT SQL"])
    with pytest.raises(Exception, match="syntax error"):
        migrate(engine, [*MIGRATIONS, broken])
    assert schema_version(engine) == MIGRATIONS[-1].version
    assert "half" not in inspect(engine).get_table_names()


def test_data_survives_a_restart(make_app, admin):
    with TestClient(make_app()) as first:
        created = first.post(
            "/api/profiles/cpu-demo/children",
            json={"name": "cpu-demo-2k", "rationale": "half the context", "context_length": 2048},
            headers=admin,
        )
        assert created.status_code == 201, created.text
        first.post("/api/profiles/maxseq1-1m/retire", headers=admin)
    with TestClient(make_app()) as second:
        child = second.get("/api/profiles/cpu-demo-2k", headers=admin).json()
        assert child["parent"] == "cpu-demo" and child["context_length"] == 2048
        assert second.get("/api/profiles/maxseq1-1m", headers=admin).json()["state"]["retired"] is True
        assert second.get("/readyz").json() == {"status": "ready"}


def test_readyz_reads_the_database(client, data_dir):
    assert client.get("/readyz").status_code == 200
    # Break the file the app really uses: readiness must notice.
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        conn.execute("DROP TABLE schema_version")
    response = client.get("/readyz")
    assert response.status_code == 503 and "database unreachable" in response.json()["detail"]
