"""Write transactions for the threads that run ladders and switches beside the request handlers.

In WAL mode SQLite fails a transaction at once with "database is locked" when it read before its first write and
another connection committed in between (SQLITE_BUSY_SNAPSHOT, which no busy timeout waits out). A transaction that
takes the write lock with its first statement waits for the lock instead (busy_timeout), then reads fresh rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine
from sqlmodel import Session

# A write that changes nothing: SQLite takes the write lock for any UPDATE, matched rows or not.
TAKE_WRITE_LOCK = "UPDATE schema_version SET version = version WHERE 0"


@contextmanager
def writing(db: Engine) -> Iterator[Session]:
    with Session(db) as session:
        session.connection().exec_driver_sql(TAKE_WRITE_LOCK)
        yield session
