"""The route's tests: a console app on a real SQLite file (TestClient) for keys, pages and refusals; a real console
process with real engine children on the shipped demo model for the route itself (test_route.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.testing import TestClient

from app.main import create_app
from app.settings import load_settings
from tests.console.conftest import ADMIN_TOKEN
from tests.support import copy_demo_model, free_port, sign_in

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# Lines of a console process's log shown with a test that failed against it (CI keeps nothing else of the run).
LOG_TAIL_LINES = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test against a console process (a `console` fixture with a `log`) reports the log's last lines: a
    switch or an engine start that went wrong says why there."""
    outcome = yield
    report = outcome.get_result()
    log = getattr(item.funcargs.get("console") if hasattr(item, "funcargs") else None, "log", None)
    if report.failed and isinstance(log, Path) and log.exists():
        tail = [line[:400] for line in log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]]
        report.sections.append((f"console log, last {len(tail)} lines ({log})", "\n".join(tail)))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("route") / "data"


@pytest.fixture(scope="module")
def client(data_dir: Path) -> Iterator[TestClient]:
    """One console for the module (no engine: its profiles' weights are missing)."""
    settings = load_settings(
        {"FLASHGATE_DATA_DIR": str(data_dir), "FLASHGATE_ADMIN_TOKEN": ADMIN_TOKEN, "FLASHGATE_INSTALL_DEMO": "0"}
    )
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture(name="sign_in")
def sign_in_fixture(client: TestClient):
    """Sign in through the console's form, leaving the session cookie on the client; returns a CSRF token."""
    return lambda name, token: sign_in(client, name, token)


def console_settings(base: Path, **extra: str) -> dict[str, str]:
    """A console process's settings: its own data folder and a models folder holding a copy of the shipped demo model
    under `base`, free ports for it and its engine, the test admin token; `extra` settings on top."""
    models = base / "models"
    copy_demo_model(models)
    return {
        "FLASHGATE_DATA_DIR": str(base / "data"),
        "FLASHGATE_MODELS_DIR": str(models),
        "FLASHGATE_PORT": str(free_port()),
        "FLASHGATE_ENGINE_PORT": str(free_port()),
        "FLASHGATE_ADMIN_TOKEN": ADMIN_TOKEN,
        "FLASHGATE_INSTALL_DEMO": "0",
        "OMP_NUM_THREADS": "1",
    } | extra
