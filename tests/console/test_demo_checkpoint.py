"""The console installs the shipped demo model (cpu-demo's weights) on first start, on a real SQLite file: every file
checked against SHA256SUMS as it is copied, into a hidden directory renamed into place. A file that does not match
fails the install naming the file and both digests (the state, the dashboard, an audit row, a log line), and leaves
nothing at models/demo; a start whose shipped model differs from the installed one installs it again."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from litestar.testing import TestClient
from structlog.testing import capture_logs

import app.main
from tests.support import DEMO_MODEL_DIR, sign_in

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of engine/demo_model that this test may change, as the directory the console installs from."""
    copy = tmp_path / "engine" / "demo_model"
    shutil.copytree(DEMO_MODEL_DIR, copy)
    monkeypatch.setattr(app.main, "DEMO_MODEL_DIR", copy)
    return copy


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextmanager
def _started(make_app, admin) -> Iterator[tuple[TestClient, dict]]:
    """The console started with the install on, and the checkpoint's status once the install ended."""
    with TestClient(make_app(FLASHGATE_INSTALL_DEMO="1")) as client:
        client.app.state.checkpoint.wait(60)
        yield client, client.get("/api/engine", headers=admin).json()["demo_checkpoint"]


def test_a_clean_first_start_installs_the_shipped_files_and_cpu_demo_can_start(make_app, admin, data_dir, shipped):
    with _started(make_app, admin) as (client, status):
        installed = data_dir / "models" / "demo"
        assert status["state"] == "present" and status["path"] == str(installed) and status["detail"] is None
        assert sorted(p.name for p in installed.iterdir()) == sorted([*FILES, "SHA256SUMS"])
        for name in [*FILES, "SHA256SUMS"]:
            assert _sha256(installed / name) == _sha256(DEMO_MODEL_DIR / name), name
        assert [p.name for p in (data_dir / "models").iterdir()] == ["demo"]  # no partial left
        profile = client.get("/api/profiles/cpu-demo", headers=admin).json()
        assert profile["model"] == "demo" and profile["state"]["blockers"] == []
        actions = [
            r["action"] for r in client.get("/api/audit", params={"target": "checkpoint:demo"}, headers=admin).json()
        ]
        assert sorted(actions) == ["checkpoint.install", "checkpoint.installed"]

    # The next start finds it installed: nothing is copied again.
    with _started(make_app, admin) as (client, status):
        assert status["state"] == "present" and status["started_at"] is None
        rows = client.get("/api/audit", params={"target": "checkpoint:demo"}, headers=admin).json()
        assert len(rows) == 2


def test_a_corrupted_shipped_file_fails_the_install_naming_it_and_installs_nothing(make_app, admin, data_dir, shipped):
    weights = shipped / "model.safetensors"
    expected = _sha256(weights)
    with weights.open("r+b") as f:  # one byte changed, the size kept
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    got = _sha256(weights)
    with capture_logs() as logs, _started(make_app, admin) as (client, status):
        assert status["state"] == "failed"
        assert status["detail"] == (
            f"the demo checkpoint could not be installed into {data_dir / 'models' / 'demo'}: {weights} has sha256 "
            f"{got}, but SHA256SUMS says {expected}"
        )
        assert not (data_dir / "models" / "demo").exists()
        assert list((data_dir / "models").iterdir()) == []  # nor half of it, hidden
        (failed,) = [e for e in logs if e["event"] == "demo_checkpoint_failed"]
        assert failed["log_level"] == "error" and failed["detail"] == status["detail"]
        rows = client.get("/api/audit", params={"target": "checkpoint:demo"}, headers=admin).json()
        assert [r["action"] for r in reversed(rows)] == ["checkpoint.install", "checkpoint.failed"]
        assert rows[0]["after"]["detail"] == status["detail"]

        # The profile stays "weights missing"; the dashboard says why.
        assert client.get("/api/profiles/cpu-demo", headers=admin).json()["state"]["blockers"] == ["weights missing"]
        sign_in(client, "admin", admin["Authorization"].removeprefix("Bearer "))
        live = client.get("/dashboard/live").text
        assert 'class="alert error"' in live and f"{weights} has sha256 {got}" in live


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json"),
        (lambda d: (d / "SHA256SUMS").write_text("not a checksum line\n"), "line 1: not a sha256sum line"),
        (lambda d: (d / "SHA256SUMS").write_text(f"{'0' * 64}  ../../etc/passwd\n"), "not a sha256sum line"),
        (lambda d: (d / "SHA256SUMS").unlink(), "no shipped demo model:"),
    ],
    ids=["missing-file", "malformed-line", "path-outside", "no-sums"],
)
def test_a_broken_shipped_model_fails_with_a_clear_detail(make_app, admin, data_dir, shipped, change, words):
    change(shipped)
    with _started(make_app, admin) as (client, status):
        assert status["state"] == "failed" and words in status["detail"], status["detail"]
        assert not (data_dir / "models" / "demo").exists() and not (data_dir / "models" / ".demo.partial").exists()


def test_a_changed_shipped_model_is_installed_again_over_the_old_one(make_app, admin, data_dir, shipped):
    with _started(make_app, admin) as (_, status):
        assert status["state"] == "present"

    # A new model shipped (as ship_demo writes it): another tokenizer_config.json and its SHA256SUMS.
    config = shipped / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "shipped": 2}', 1))
    sums = shipped / "SHA256SUMS"
    sums.write_text("".join(f"{_sha256(shipped / name)}  {name}\n" for name in FILES))
    with _started(make_app, admin) as (client, status):
        installed = data_dir / "models" / "demo"
        assert status["state"] == "present" and status["started_at"] is not None
        assert (installed / "tokenizer_config.json").read_text() == config.read_text()
        assert (installed / "SHA256SUMS").read_text() == sums.read_text()
        assert [p.name for p in (data_dir / "models").iterdir()] == ["demo"]  # the old one is gone
        rows = client.get("/api/audit", params={"target": "checkpoint:demo"}, headers=admin).json()
        assert [r["action"] for r in reversed(rows)][2:] == ["checkpoint.install", "checkpoint.installed"]
        assert rows[1]["after"]["replaces"] is True


def test_with_the_install_off_nothing_is_installed(client, admin, data_dir):
    assert client.get("/api/engine", headers=admin).json()["demo_checkpoint"]["state"] == "missing"
    assert not (data_dir / "models" / "demo").exists()
