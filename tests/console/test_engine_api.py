"""The engine API and dashboard without an engine running: preflight refusals name the field and the path or the
numbers and write nothing; the idle state; telemetry on a CPU host (NVML absent) and, through the fake NVML behind
the real interface, on a GPU host and under WSL2; the dashboard's controls by role; OpenAPI."""

from __future__ import annotations

import sqlite3
import time

from litestar.testing import TestClient

from tests.console.conftest import ADMIN_TOKEN
from tests.console.fake_nvml import GIB, FakeGpu, FakeNvml
from tests.support import sign_in

HTMX = {"HX-Request": "true"}


def counts(data_dir) -> tuple[int, int]:
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        return (
            conn.execute("SELECT count(*) FROM engine_run").fetchone()[0],
            conn.execute("SELECT count(*) FROM audit").fetchone()[0],
        )


def test_idle_engine(client, viewer):
    engine = client.get("/api/engine", headers=viewer).json()
    assert engine["state"] == "idle" and engine["run"] is None and engine["profile"] is None
    assert engine["driver"] == "process" and engine["engine_url"] == "http://127.0.0.1:30000"
    assert engine["demo_checkpoint"]["state"] == "missing"
    assert client.get("/api/engine/runs", headers=viewer).json() == []
    logs = client.get("/api/engine/logs", headers=viewer)
    assert logs.status_code == 404 and "no engine has run yet" in logs.json()["detail"]


def test_reading_needs_a_signed_in_viewer(client):
    for path in ("/api/engine", "/api/engine/runs", "/api/engine/logs", "/api/telemetry"):
        assert client.get(path).status_code == 401, path
    for path in ("/dashboard", "/dashboard/live", "/engine/runs/1"):
        assert client.get(path, follow_redirects=False).headers["location"].startswith("/signin?next="), path


def test_preflight_refuses_missing_weights_naming_the_path(client, operator, data_dir):
    before = counts(data_dir)
    response = client.post("/api/engine/start", json={"profile": "cpu-demo"}, headers=operator)
    assert response.status_code == 409
    path = data_dir / "models" / "demo"
    assert response.json()["detail"] == f"preflight refused profile 'cpu-demo': weights missing: {path} does not exist"
    checks = {c["name"]: c for c in response.json()["extra"]}
    assert checks["weights"]["status"] == "fail"
    # Host rules come with it, each naming its field and limit.
    field = client.post("/api/engine/start", json={"profile": "maxseq16-128k"}, headers=operator).json()
    assert (
        "tensor_parallel_size must be at most 1 (one engine process per GPU; this host shows no GPU" in field["detail"]
    )
    assert "DeepSeek-V4-Flash does not exist" in field["detail"]
    assert counts(data_dir) == before


def test_unknown_and_retired_profiles(client, operator, data_dir):
    unknown = client.post("/api/engine/start", json={"profile": "nope"}, headers=operator)
    assert unknown.status_code == 404 and unknown.json()["detail"] == "no profile named 'nope'"
    client.post("/api/profiles/maxseq1-1m/retire", headers=operator)
    retired = client.post("/api/engine/start", json={"profile": "maxseq1-1m"}, headers=operator)
    assert retired.status_code == 409 and "profile 'maxseq1-1m' is retired" in retired.json()["detail"]
    body = client.post("/api/engine/start", json={"profile": "cpu-demo", "force": True}, headers=operator)
    assert body.status_code == 400 and "force" in body.text


def test_stop_and_restart_with_nothing_running(client, operator, data_dir):
    before = counts(data_dir)
    stop = client.post("/api/engine/stop", headers=operator)
    assert stop.status_code == 409 and stop.json()["detail"] == "no engine is running"
    for body in ({"json": {}}, {}):
        restart = client.post("/api/engine/restart", headers=operator, **body)
        assert restart.status_code == 409 and "nothing to restart" in restart.json()["detail"]
    # A restart checks the profile before it stops anything.
    refused = client.post("/api/engine/restart", json={"profile": "cpu-demo"}, headers=operator)
    assert refused.status_code == 409 and "weights missing" in refused.json()["detail"]
    assert counts(data_dir) == before


def test_telemetry_on_a_cpu_host(client, viewer):
    telemetry = client.get("/api/telemetry", headers=viewer).json()
    assert telemetry["engine"] is None and telemetry["interval_s"] == 2.0
    if telemetry["gpus"] is not None:  # the sampler's first reading may still be on its way
        assert telemetry["gpus"]["available"] is False and "NVML" in telemetry["gpus"]["reason"]
        assert telemetry["gpus"]["devices"] == []


def test_preflight_refuses_when_the_gpu_lacks_the_memory_the_profile_claims(gpu_console, data_dir):
    busy = FakeNvml([FakeGpu(name="NVIDIA H100 80GB HBM3", total=80 * GIB, used=70 * GIB)])
    with gpu_console(busy) as client:
        before = counts(data_dir)
        response = client.post("/api/engine/start", json={"profile": "cpu-demo"}, headers=_admin())
        assert response.status_code == 409
        assert response.json()["detail"] == (
            "preflight refused profile 'cpu-demo': GPU 0 (NVIDIA H100 80GB HBM3): 10.0 GiB free, but the profile "
            "claims gpu_memory_utilization 0.5 × 80.0 GiB = 40.0 GiB: free the GPU or lower gpu_memory_utilization"
        )
        checks = {c["name"]: c["status"] for c in response.json()["extra"]}
        assert checks == {"weights": "ok", "vram": "fail", "engine_port": "ok"}
        assert counts(data_dir) == before


def test_gpu_telemetry_degrades_per_metric_under_wsl(gpu_console):
    with gpu_console(FakeNvml([FakeGpu(), FakeGpu(used=90 * GIB)], wsl=True)) as client:
        telemetry = _sampled(client)
        gpus = telemetry["gpus"]
        assert gpus["available"] is True and gpus["wsl"] is True and gpus["driver_version"] == "570.124.06"
        first, second = gpus["devices"]
        assert first["name"] == "NVIDIA H200" and first["free_bytes"] == 140 * GIB and second["free_bytes"] == 51 * GIB
        assert first["temperature_c"] == 34 and first["power_w"] == 74.0
        assert first["utilization_pct"] is None  # n/a under WSL2, never 0
        assert "Task Manager" in gpus["notes"][0]
        assert telemetry["history"][-1]["gpu_free_bytes"] == [140 * GIB, 51 * GIB]
        sign_in(client, "admin", ADMIN_TOKEN)
        page = client.get("/dashboard/live")
        assert "140.0 GiB free</strong> of 141.0 GiB" in page.text and "51.0 GiB free" in page.text
        assert "utilisation n/a" in page.text and "34 °C" in page.text and "74 W" in page.text


def test_dashboard_controls_follow_the_role(client, operator_token, sign_in):
    sign_in("vera", operator_token("vera", "viewer"))
    page = client.get("/dashboard")
    assert page.status_code == 200 and 'hx-get="/dashboard/live"' in page.text and 'hx-trigger="every 2s' in page.text
    assert 'class="start-form"' not in page.text and "No engine runs yet." in page.text
    assert '<a href="/dashboard" aria-current="page">Dashboard</a>' in page.text
    assert client.get("/", follow_redirects=False).headers["location"] == "/dashboard"
    csrf = sign_in("otto", operator_token("otto", "operator"))
    live = client.get("/dashboard/live")
    assert 'class="start-form"' in live.text
    assert '<option value="cpu-demo" disabled' in live.text and "cpu-demo — weights missing" in live.text
    refused = client.post("/engine/start", data={"profile": "cpu-demo", "_csrf_token": csrf}, headers=HTMX)
    assert refused.status_code == 409 and refused.headers["hx-retarget"] == "#notice"
    assert "weights missing" in refused.text
    empty = client.post("/engine/start", data={"profile": "", "_csrf_token": csrf}, headers=HTMX)
    assert empty.status_code == 422 and "profile is required" in empty.text


def test_the_selected_profile_survives_a_refresh(gpu_console):
    with gpu_console(FakeNvml()) as client:
        client.post(
            "/api/profiles/cpu-demo/children",
            json={"name": "cpu-demo-2k", "rationale": "half the context", "context_length": 2048},
            headers=_admin(),
        )
        sign_in(client, "admin", ADMIN_TOKEN)
        assert '<option value="cpu-demo"  selected>' in client.get("/dashboard/live").text
        kept = client.get("/dashboard/live", params={"profile": "cpu-demo-2k"}).text
        assert '<option value="cpu-demo-2k"  selected>' in kept and 'hx-include="#start-profile"' in kept


def test_openapi_lists_the_engine_and_telemetry_api(client):
    paths = client.get("/schema/openapi.json").json()["paths"]
    for path in (
        "/api/engine",
        "/api/engine/start",
        "/api/engine/stop",
        "/api/engine/restart",
        "/api/engine/runs",
        "/api/engine/logs",
        "/api/telemetry",
    ):
        assert path in paths, path
    assert not any(p.startswith(("/dashboard", "/engine")) for p in paths)


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _sampled(client: TestClient) -> dict:
    deadline = time.monotonic() + 5
    while (telemetry := client.get("/api/telemetry", headers=_admin()).json())["gpus"] is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return telemetry
