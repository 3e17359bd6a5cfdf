"""The route's tests: a console app on a real SQLite file (TestClient) for keys, pages and refusals; a real console
process with real engine children on the tiny checkpoint for the route itself (test_route.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.testing import TestClient

from app.main import create_app
from app.settings import load_settings
from tests.console.conftest import ADMIN_TOKEN
from tests.support import sign_in

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("route") / "data"


@pytest.fixture(scope="module")
def client(data_dir: Path) -> Iterator[TestClient]:
    """One console for the module (no engine: its profiles' weights are missing)."""
    settings = load_settings(
        {"FLASHGATE_DATA_DIR": str(data_dir), "FLASHGATE_ADMIN_TOKEN": ADMIN_TOKEN, "FLASHGATE_MAKE_TINY": "0"}
    )
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture(name="sign_in")
def sign_in_fixture(client: TestClient):
    """Sign in through the console's form, leaving the session cookie on the client; returns a CSRF token."""
    return lambda name, token: sign_in(client, name, token)
