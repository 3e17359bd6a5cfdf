"""The console app on a real SQLite file in tmp_path, driven through Litestar's TestClient."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from app.main import create_app
from app.settings import load_settings
from app.telemetry.gpus import NvmlGpus
from tests.console.fake_nvml import FakeNvml
from tests.support import form_csrf, sign_in

ADMIN_TOKEN = "fg_test-admin-token"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _page_csrf(client: TestClient, path: str) -> str:
    """The CSRF token a page embeds in its forms (its cookie is now on the client)."""
    page = client.get(path)
    assert page.status_code == 200, page.text
    return form_csrf(page.text)


@pytest.fixture
def bearer() -> Callable[[str], dict[str, str]]:
    return _bearer


@pytest.fixture
def page_csrf() -> Callable[[TestClient, str], str]:
    return _page_csrf


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def make_app(data_dir: Path) -> Callable[..., Litestar]:
    """Build the app on the test's data directory; call again to "restart" on the same database file."""

    def make(**env: str) -> Litestar:
        """`FLASHGATE_ADMIN_TOKEN=""` starts without an admin token (the setup-token path). The demo model is not
        installed unless a test asks (`FLASHGATE_INSTALL_DEMO="1"`): most tests want "weights missing"."""
        base = {
            "FLASHGATE_DATA_DIR": str(data_dir),
            "FLASHGATE_ADMIN_TOKEN": ADMIN_TOKEN,
            "FLASHGATE_INSTALL_DEMO": "0",
        }
        return create_app(load_settings({**base, **env}))

    return make


@pytest.fixture
def client(make_app) -> Iterator[TestClient]:
    with TestClient(make_app()) as test_client:
        yield test_client


@pytest.fixture
def admin() -> dict[str, str]:
    return _bearer(ADMIN_TOKEN)


@pytest.fixture
def operator_token(client: TestClient, admin) -> Callable[[str, str], str]:
    """Create an operator with a role through the API; returns its token's secret."""

    def create(name: str, role: str) -> str:
        response = client.post("/api/operators", json={"name": name, "role": role}, headers=admin)
        assert response.status_code == 201, response.text
        return response.json()["token"]["secret"]

    return create


@pytest.fixture
def viewer(operator_token) -> dict[str, str]:
    return _bearer(operator_token("vera", "viewer"))


@pytest.fixture
def operator(operator_token) -> dict[str, str]:
    return _bearer(operator_token("otto", "operator"))


@pytest.fixture(name="sign_in")
def sign_in_fixture(client: TestClient) -> Callable[[str, str], str]:
    """Sign in through the console's form, leaving the session cookie on the client; returns a CSRF token."""
    return lambda name, token: sign_in(client, name, token)


@pytest.fixture
def gpu_console(data_dir, demo_models_dir):
    """The console on a "GPU host": the real NVML code over the fake pynvml, weights present."""

    def make(nvml: FakeNvml) -> TestClient:
        settings = load_settings(
            {
                "FLASHGATE_DATA_DIR": str(data_dir),
                "FLASHGATE_MODELS_DIR": str(demo_models_dir),
                "FLASHGATE_ADMIN_TOKEN": ADMIN_TOKEN,
                "FLASHGATE_INSTALL_DEMO": "0",
                "FLASHGATE_TELEMETRY_INTERVAL_S": "0.2",
            }
        )
        return TestClient(create_app(settings, gpus=NvmlGpus(nvml=nvml, wsl=nvml.wsl)))

    return make
