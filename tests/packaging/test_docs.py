"""docs/deploy.md: every command block is either run here (its `tested:` note names the test below that runs it) or
says why it cannot be (a Docker daemon, a GPU, Windows); the database backup and restore blocks run against a live
WAL database; the systemd unit passes `systemd-analyze verify`; the README points at all of it."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.main import prepare_database
from app.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = (ROOT / "docs" / "deploy.md").read_text()
README = (ROOT / "README.md").read_text()
NOTE = re.compile(r"^\s*<!-- (tested: (?P<test>\S+)|not run here: .+) -->\s*$")
FENCE = re.compile(r"^\s*```")


def blocks() -> list[tuple[str | None, str, str]]:
    """(the test named in the note or None, the note, the block's text) for each fenced block, in order."""
    lines, found, index = DEPLOY.splitlines(), [], 0
    while index < len(lines):
        if not FENCE.match(lines[index]):
            index += 1
            continue
        indent = len(lines[index]) - len(lines[index].lstrip())
        end = next(i for i in range(index + 1, len(lines)) if FENCE.match(lines[i]))
        body = "\n".join(line[indent:] for line in lines[index + 1 : end])
        above = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        note = NOTE.match(above)
        assert note, f"docs/deploy.md line {index + 1}: a command block without a tested/not-run note:\n{body}"
        found.append((note.group("test"), above.strip(), body))
        index = end + 1
    return found


def block_tested_by(test: str) -> str:
    bodies = [body for name, _, body in blocks() if name == f"tests/packaging/test_docs.py::{test}"]
    assert len(bodies) == 1, test
    return bodies[0]


def test_every_command_block_is_tested_or_says_why_not():
    found = blocks()
    assert len(found) >= 10
    for test, note, _ in found:
        if test is None:
            assert len(note) > len("<!-- not run here:  -->") + 10, note
            continue
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.MULTILINE), test
    assert {test for test, _, _ in found if test} == {
        "tests/packaging/test_docs.py::test_native_backup_block",
        "tests/packaging/test_docs.py::test_sqlite3_backup_block",
        "tests/packaging/test_docs.py::test_restore_block",
        # On CI's Docker daemon (tests/container/): the CPU build, the CPU file set, the docker-driver profile.
        "tests/container/conftest.py::image",
        "tests/container/test_stack.py::test_default_stack_serves_through_the_route_and_keeps_its_volume",
        "tests/container/test_docker_driver.py::test_console_drives_the_engine_container_through_the_proxy",
    }


def test_docs_cover_the_hosts_and_the_socket_warning():
    for heading in (
        "## Linux with the NVIDIA container toolkit",
        "## Air-gapped hosts",
        "## A CPU host",
        "## Windows 11 with Docker Desktop and WSL2",
        "## Without Docker: systemd",
        "## Upgrading",
        "## Backing up and restoring the database",
    ):
        assert heading in DEPLOY, heading
    for topic in (".wslconfig", "wsl --shutdown", "NVML", "Pinned memory", "another GPU", "root-equivalent"):
        assert topic in DEPLOY, topic


def test_readme_links_the_deploy_docs_and_lists_the_new_settings():
    assert "(docs/deploy.md)" in README
    assert "not built in CI" in README and "docker compose build" in README and "--build-arg" in README
    # Both file sets, and which steps CI exercises and which only a GPU host does.
    assert "docker compose -f compose.yaml -f compose.gpu.yaml up -d" in README and "docker compose up -d" in README
    assert "What CI exercises" in README and "What only a GPU host exercises" in README
    assert "make wheelhouse" in README and "make wheelhouse" in DEPLOY and "WHEELHOUSE=1" in DEPLOY
    for setting in ("FLASHGATE_BUILD", "FLASHGATE_PYTHON", "FLASHGATE_GPU_COUNT", "FLASHGATE_PUBLISH"):
        assert f"`{setting}`" in README, setting


@dataclass
class Live:
    settings: Settings
    writer: sqlite3.Connection

    @property
    def data_dir(self) -> Path:
        return self.settings.data_dir

    @property
    def database_path(self) -> Path:
        return self.settings.database_path


@pytest.fixture
def live_database(tmp_path):
    """The console's own database (migrated, profiles seeded, WAL), plus rows a connection still holds in the WAL:
    the state a plain cp of flashgate.sqlite3 gets wrong."""
    data_dir = tmp_path / "data"
    settings = load_settings({"FLASHGATE_DATA_DIR": str(data_dir), "FLASHGATE_ADMIN_TOKEN": "fg_docs-test"})
    data_dir.mkdir()
    engine, _ = prepare_database(settings)
    engine.dispose()
    writer = sqlite3.connect(settings.database_path, isolation_level=None)
    writer.execute("PRAGMA wal_autocheckpoint=0")
    writer.execute("CREATE TABLE backup_probe (n INTEGER)")
    writer.executemany("INSERT INTO backup_probe VALUES (?)", [(n,) for n in range(100)])
    assert writer.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    yield Live(settings, writer)
    writer.close()


def _rows(path: Path, sql: str) -> int:
    with closing(sqlite3.connect(path)) as db:
        return db.execute(sql).fetchone()[0]


def _run_block(block: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", "-eu", "-c", block],
        cwd=ROOT,
        env={**os.environ, "FLASHGATE_PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_native_backup_block(live_database):
    data_dir = live_database.data_dir
    # A plain copy of the live file misses what is still in the WAL.
    shutil.copy(live_database.database_path, data_dir / "naive-copy.sqlite3")
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        _rows(data_dir / "naive-copy.sqlite3", "SELECT count(*) FROM backup_probe")

    done = _run_block(block_tested_by("test_native_backup_block"), FLASHGATE_DATA_DIR=str(data_dir))
    assert done.returncode == 0, done.stderr
    [backup] = (data_dir / "backups").glob("flashgate-*.sqlite3")
    assert re.fullmatch(r"flashgate-\d{8}-\d{6}\.sqlite3", backup.name)
    assert _rows(backup, "SELECT count(*) FROM backup_probe") == 100
    assert _rows(backup, "SELECT count(*) FROM profile") == _rows(
        live_database.database_path, "SELECT count(*) FROM profile"
    )
    # One self-contained file, and a second backup never overwrites it.
    assert _rows(backup, "PRAGMA journal_mode") == "delete"
    assert sorted(p.name for p in backup.parent.iterdir()) == [backup.name]
    again = subprocess.run(
        ["sh", str(ROOT / "bin" / "flashgate"), "backup", str(backup)],
        env={**os.environ, "FLASHGATE_PYTHON": sys.executable, "FLASHGATE_DATA_DIR": str(data_dir)},
        capture_output=True,
        text=True,
    )
    assert again.returncode == 1 and "exists; choose a new file" in again.stderr


def test_sqlite3_backup_block(live_database):
    if shutil.which("sqlite3") is None:
        pytest.skip("the sqlite3 command-line shell is not installed (Debian: apt-get install sqlite3)")
    data_dir = live_database.data_dir
    (data_dir / "backups").mkdir()
    done = _run_block(block_tested_by("test_sqlite3_backup_block"), FLASHGATE_DATA_DIR=str(data_dir))
    assert done.returncode == 0, done.stderr
    assert _rows(data_dir / "backups" / "flashgate-sqlite3.sqlite3", "SELECT count(*) FROM backup_probe") == 100


def test_restore_block(live_database):
    data_dir, database = live_database.data_dir, live_database.database_path
    backup = data_dir / "backups" / "before.sqlite3"
    taken = subprocess.run(
        ["sh", str(ROOT / "bin" / "flashgate"), "backup", str(backup)],
        env={**os.environ, "FLASHGATE_PYTHON": sys.executable, "FLASHGATE_DATA_DIR": str(data_dir)},
        capture_output=True,
        text=True,
    )
    assert taken.returncode == 0, taken.stderr
    live_database.writer.close()  # the console stops before a restore
    # Later writes, left in the WAL by a console that then stopped uncleanly.
    with closing(sqlite3.connect(database, isolation_level=None)) as later:
        later.execute("PRAGMA wal_autocheckpoint=0")
        later.execute("INSERT INTO backup_probe VALUES (1000)")
        assert (data_dir / "flashgate.sqlite3-wal").exists()
        stale_wal = (data_dir / "flashgate.sqlite3-wal").read_bytes()
    (data_dir / "flashgate.sqlite3-wal").write_bytes(stale_wal)

    done = _run_block(block_tested_by("test_restore_block"), FLASHGATE_DATA_DIR=str(data_dir), BACKUP=str(backup))
    assert done.returncode == 0, done.stderr
    assert not (data_dir / "flashgate.sqlite3-wal").exists() and not (data_dir / "flashgate.sqlite3-shm").exists()
    assert _rows(database, "SELECT count(*) FROM backup_probe") == 100
    # The console opens the restored database as it is (migrations are already applied).
    engine, _ = prepare_database(live_database.settings)
    engine.dispose()


def test_systemd_unit():
    unit_path = ROOT / "deploy" / "flashgate.service"
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string(unit_path.read_text())
    service = unit["Service"]
    assert service["ExecStart"] == "/opt/flashgate/bin/flashgate console"
    assert service["KillMode"] == "mixed" and service["User"] == "flashgate"
    assert float(service["TimeoutStopSec"]) > load_settings({}).engine_grace_s
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the unit's syntax is not verified")
    # Verified as installed over this checkout (the unit names /opt/flashgate).
    local = Path(os.environ.get("TMPDIR", "/tmp")) / f"flashgate-verify-{os.getpid()}.service"
    local.write_text(unit_path.read_text().replace("/opt/flashgate", str(ROOT)))
    try:
        verified = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True, timeout=60)
    finally:
        local.unlink()
    assert verified.returncode == 0, verified.stderr
