"""One engine over several GPUs, from the console's side, on a real SQLite file: a profile's attention mode and GPUs
through the REST API and the make-child form (a round trip, and each refusal a 4xx naming the field and the limit),
the profile page's words for the mode, the preflight per GPU, the dashboard's GPUs beside the engine's ranks, what
the process and docker drivers hand the engine, and a database from before the two settings. A "GPU host" is the
real NVML code over the fake pynvml (tests/console/fake_nvml.py)."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
import yaml
from litestar.testing import TestClient
from sqlmodel import Session, select

from app.db import MIGRATIONS, create_db_engine, migrate
from app.engine_control.docker_driver import DockerDriver
from app.engine_control.driver import EngineCommand, engine_args, engine_env
from app.engine_control.models import EngineRun, RunState
from app.engine_control.process_driver import ProcessDriver
from app.main import SEED_DIR
from app.profiles.models import Profile
from app.profiles.schemas import content_hash
from app.profiles.service import settings_of
from app.settings import load_settings
from tests.console.conftest import ADMIN_TOKEN
from tests.console.fake_nvml import GIB, FakeGpu, FakeNvml
from tests.support import free_port, sign_in

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
HTMX = {"HX-Request": "true"}
# maxseq16-128k's content hash before profiles had attention and gpus (tests/unit/test_profile_rules.py).
FIELD_128K_HASH = "c02634ed8a90924b9564e0290ddcd8f6dfd9a624083aad855f5405a90a69659d"


@pytest.fixture
def gpu_host(gpu_console):
    """The console on a host with these GPUs (NVML's indices 0..n-1), the tiny checkpoint's weights present."""
    return lambda *gpus: gpu_console(FakeNvml(list(gpus)))


def counts(data_dir: Path) -> tuple[int, int, int]:
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        return tuple(
            conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] for table in ("profile", "engine_run", "audit")
        )


def test_attention_and_gpus_round_trip_through_the_api(gpu_host, data_dir):
    with gpu_host(FakeGpu(), FakeGpu(), FakeGpu(), FakeGpu()) as client:
        parent = client.get("/api/profiles/maxseq16-128k", headers=ADMIN).json()
        assert parent["content_hash"] == FIELD_128K_HASH and parent["state"]["tensor_parallel_available"] is True
        assert parent["state"]["blockers"] == ["weights missing"]  # four GPUs here: only the weights are missing

        created = client.post(
            "/api/profiles/maxseq16-128k/children",
            json={
                "name": "maxseq16-128k-tp",
                "rationale": "the field's layout: heads split",
                "attention": "tensor-parallel",
            },
            headers=ADMIN,
        )
        assert created.status_code == 201, created.text
        child = created.json()
        assert (child["attention"], child["gpus"], child["tensor_parallel_size"]) == ("tensor-parallel", None, 2)
        assert [(c["field"], c["parent"], c["value"]) for c in child["diff"]] == [
            ("attention", "data-parallel", "tensor-parallel")
        ]
        assert child["content_hash"] != FIELD_128K_HASH and child["warnings"] == []
        only_attention = child["content_hash"]

        pinned = client.patch("/api/profiles/maxseq16-128k-tp", json={"gpus": [3, 1]}, headers=ADMIN)
        assert pinned.status_code == 200, pinned.text
        assert pinned.json()["gpus"] == [3, 1] and pinned.json()["content_hash"] not in (
            only_attention,
            FIELD_128K_HASH,
        )
        assert "2 settings differ from the parent (attention, gpus)" in pinned.json()["warnings"][0]
        assert client.get("/api/profiles/maxseq16-128k-tp", headers=ADMIN).json()["gpus"] == [3, 1]
        update = client.get("/api/audit", params={"action": "profile.update"}, headers=ADMIN).json()[0]
        assert (update["before"]["gpus"], update["after"]["gpus"]) == (None, [3, 1])
        assert update["after"]["attention"] == "tensor-parallel"

        # Back to none named: the hash is what it was with the attention change alone.
        unpinned = client.patch("/api/profiles/maxseq16-128k-tp", json={"gpus": None}, headers=ADMIN).json()
        assert unpinned["gpus"] is None and unpinned["content_hash"] == only_attention


@pytest.mark.parametrize(
    ("body", "field", "limit"),
    [
        ({"gpus": [0, 7]}, "gpus", "this host shows 4 GPUs (0, 1, 2, 3)), got [0, 7]: GPU 7 is not there"),
        ({"gpus": [1, 1]}, "gpus", "gpus must name each GPU once, got [1, 1]"),
        ({"gpus": [0, 1, 2]}, "gpus", "gpus must list tensor_parallel_size (2) GPUs, one per engine process, got 3"),
        ({"gpus": [-1, 0]}, "gpus", "GPU indices (whole numbers, 0 or more), got [-1, 0]"),
        (
            {"tensor_parallel_size": 8},
            "tensor_parallel_size",
            "at most 4 (one engine process per GPU; this host shows 4",
        ),
        ({"attention": "expert-parallel"}, "attention", "one of data-parallel, tensor-parallel; got 'expert-parallel'"),
    ],
)
def test_each_gpu_rule_is_a_422_naming_the_field_and_the_limit(gpu_host, data_dir, body, field, limit):
    with gpu_host(FakeGpu(), FakeGpu(), FakeGpu(), FakeGpu()) as client:
        before = counts(data_dir)
        request = {"name": "maxseq16-128k-bad", "rationale": "testing a rule", **body}
        response = client.post("/api/profiles/maxseq16-128k/children", json=request, headers=ADMIN)
        assert response.status_code == 422, response.text
        assert [(e["field"], limit in e["message"]) for e in response.json()["extra"]] == [(field, True)]
        assert counts(data_dir) == before


def test_gpus_of_the_wrong_type_are_refused_naming_the_field(client, admin, data_dir):
    before = counts(data_dir)
    for gpus in ("0,1", [0.5, 1], [True, False]):
        request = {"name": "cpu-demo-bad", "rationale": "r", "gpus": gpus}
        response = client.post("/api/profiles/cpu-demo/children", json=request, headers=admin)
        assert response.status_code == 400 and "gpus" in response.text and "Expected" in response.text, gpus
    assert counts(data_dir) == before


def _form(profile: dict, **changes: str) -> dict[str, str]:
    """The make-child form as the page fills it from the parent, with the operator's changes."""
    values = {f: "" if profile[f] is None else str(profile[f]) for f in ("model", "revision", "dtype")}
    for f in ("context_length", "max_num_batched_tokens", "max_num_seqs", "cuda_graph_max_bs", "tensor_parallel_size"):
        values[f] = str(profile[f])
    values |= {
        "gpu_memory_utilization": str(profile["gpu_memory_utilization"]),
        "kv_cache_dtype": profile["kv_cache_dtype"],
        "attention": profile["attention"],
        "gpus": ",".join(str(i) for i in profile["gpus"] or []),
        "max_output_tokens": str(profile["max_output_tokens"]),
        "engine_extras": json.dumps(profile["engine_extras"]),
    }
    return values | changes


def test_attention_and_gpus_round_trip_through_the_form(gpu_host):
    with gpu_host(FakeGpu(), FakeGpu(), FakeGpu(), FakeGpu()) as client:
        csrf = sign_in(client, "admin", ADMIN_TOKEN)
        page = client.get("/profiles/maxseq16-128k/child").text
        assert (
            '<select id="f-attention" name="attention">' in page and "<option selected>data-parallel</option>" in page
        )
        assert 'name="gpus" value=""' in page and 'placeholder="the first 2"' in page
        parent = client.get("/api/profiles/maxseq16-128k", headers=ADMIN).json()

        base = {"_csrf_token": csrf, "name": "maxseq16-128k-pinned", "rationale": "GPUs 2 and 3, heads split"}
        unreadable = client.post(
            "/profiles/maxseq16-128k/children", data=base | _form(parent, gpus="two,three"), headers=HTMX
        )
        assert unreadable.status_code == 422
        assert 'id="error-gpus">gpus must be GPU indices separated by commas, such as 0,1' in unreadable.text
        three = client.post("/profiles/maxseq16-128k/children", data=base | _form(parent, gpus="0,1,2"), headers=HTMX)
        assert three.status_code == 422 and "gpus must list tensor_parallel_size (2) GPUs" in three.text

        form = _form(parent, attention="tensor-parallel", gpus="2, 3")
        created = client.post("/profiles/maxseq16-128k/children", data=base | form, headers=HTMX)
        assert created.status_code == 200 and created.headers["hx-redirect"] == "/profiles/maxseq16-128k-pinned"
        child = client.get("/api/profiles/maxseq16-128k-pinned", headers=ADMIN).json()
        assert (child["attention"], child["gpus"]) == ("tensor-parallel", [2, 3])

        detail = client.get("/profiles/maxseq16-128k-pinned").text
        assert "GPU 2, 3 (<code>gpus</code>, the engine's <code>CUDA_VISIBLE_DEVICES</code>)" in detail
        assert "<strong>tensor-parallel</strong>: the attention heads are split over the GPUs" in detail
        assert 'class="before">data-parallel' in detail and 'class="after">tensor-parallel' in detail
        # The child form of the child shows its GPUs as they were typed in.
        assert 'name="gpus" value="2,3"' in client.get("/profiles/maxseq16-128k-pinned/child").text


def test_the_profile_page_says_the_mode_what_it_trades_and_the_gpus(client, operator_token, sign_in):
    sign_in("otto", operator_token("otto", "operator"))  # an operator also sees what a disabled Qualify needs
    dp = client.get("/profiles/flash-2gpu-dp-128k").text
    assert "<strong>data-parallel</strong>: each GPU holds a replica of the dense attention weights" in dp
    assert "KV capacity is the sum over the GPUs" in dp and "the other GPUs idle" in dp
    assert "Qualification on your own hardware decides which mode serves best." in dp
    assert "2, one engine process each:" in dp and "the first 2 the console sees" in dp
    # On this CPU host the profile is kept, with what it needs.
    assert "more GPUs than this host has" in dp and "2 GPUs with enough memory for its share of the weights" in dp
    assert "this host shows no GPU" in dp
    tp = client.get("/profiles/flash-4gpu-tp-1m").text
    assert "<strong>tensor-parallel</strong>" in tp and "best single-stream latency" in tp
    assert "one copy of the KV cache per GPU" in tp
    assert "which one GPU does not split" in client.get("/profiles/cpu-demo").text


def test_the_preflight_checks_every_chosen_gpu(gpu_host, data_dir):
    # GPU 2 has 100 GiB in use by something else.
    with gpu_host(FakeGpu(), FakeGpu(), FakeGpu(used=100 * GIB), FakeGpu()) as client:
        made = client.post(
            "/api/profiles/cpu-demo/children",
            json={"name": "tiny-2gpu", "rationale": "two GPUs", "tensor_parallel_size": 2, "gpus": [3, 2]},
            headers=ADMIN,
        )
        assert made.status_code == 201, made.text
        before = counts(data_dir)
        refused = client.post("/api/engine/start", json={"profile": "tiny-2gpu"}, headers=ADMIN)
        assert refused.status_code == 409, refused.text
        vram = [c for c in refused.json()["extra"] if c["name"] == "vram"]
        assert [(c["status"], c["detail"].split(":")[0]) for c in vram] == [
            ("ok", "GPU 3 (NVIDIA H200, rank 0)"),
            ("fail", "GPU 2 (NVIDIA H200, rank 1)"),
        ]
        assert "split over 2 GPUs, an estimate" in vram[0]["detail"]
        assert refused.json()["detail"] == (
            "preflight refused profile 'tiny-2gpu': GPU 2 (NVIDIA H200, rank 1): 41.0 GiB free, but the profile "
            "claims gpu_memory_utilization 0.5 × 141.0 GiB = 70.5 GiB: free the GPU or lower gpu_memory_utilization"
        )
        assert counts(data_dir) == before


def _sampled(client: TestClient) -> None:
    deadline = time.monotonic() + 5
    while client.get("/api/telemetry", headers=ADMIN).json()["gpus"] is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_the_dashboard_shows_each_gpu_beside_the_engine_rank_on_it(gpu_host, data_dir):
    with gpu_host(FakeGpu(used=100 * GIB), FakeGpu(used=90 * GIB), FakeGpu()) as client:
        _sampled(client)
        # A ready run on GPUs 1 and 0, as the supervisor records one: its environment and its /server_info.
        rank = {"total_bytes": 141 * GIB, "free_bytes": 40 * GIB, "graph_bytes": GIB // 2}
        info = {
            "config": {"tensor_parallel_size": 2, "attention": "data-parallel", "context_length": 131072},
            "kv_capacity_tokens": 2_000_000,
            "kv_pages": 7812,
            "max_concurrency_at_full_context": 15.2,
            "gpu_memory": {**rank, "weights_bytes": 80 * GIB, "kv_bytes": 30 * GIB},
            "gpu_memory_per_rank": [
                {**rank, "weights_bytes": 80 * GIB, "kv_bytes": 30 * GIB},
                {**rank, "weights_bytes": 81 * GIB, "kv_bytes": 29 * GIB},
            ],
        }
        with Session(create_db_engine(data_dir / "flashgate.sqlite3")) as session:
            profile = session.exec(select(Profile).where(Profile.name == "flash-2gpu-dp-128k")).one()
            run = EngineRun(
                profile_id=profile.id,
                content_hash=profile.content_hash,
                weights_fingerprint="f",
                driver="process",
                state=RunState.ready,
                command=["--tensor-parallel-size", "2"],
                environment={"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
                preflight=[],
                started_by="admin",
                log_path=str(data_dir / "none.log"),
                server_info=info,
            )
            session.add(run)
            session.commit()
            run_id = run.id
        sign_in(client, "admin", ADMIN_TOKEN)
        live = client.get("/dashboard/live").text
        gpu = {i: live.split(f'id="gpu-{i}"')[1].split('<div class="gpu"')[0] for i in range(3)}
        assert "engine rank 0" in gpu[1] and "weights 81.0 GiB" not in gpu[1] and "weights 80.0 GiB" in gpu[1]
        assert "41.0 GiB free</strong> of 141.0 GiB" in gpu[0] and "engine rank 1" in gpu[0]
        assert "weights 81.0 GiB · KV cache 29.0 GiB · CUDA graphs 512.0 MiB" in gpu[0]
        assert "51.0 GiB free</strong> of 141.0 GiB" in gpu[1]
        assert "engine rank" not in gpu[2] and "140.0 GiB free" in gpu[2]
        page = client.get(f"/engine/runs/{run_id}").text
        assert (
            "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=1,0 python -m engine serve --tensor-parallel-size 2"
            in page
        )
        assert client.get("/api/engine", headers=ADMIN).json()["run"]["environment"]["CUDA_VISIBLE_DEVICES"] == "1,0"


def _profile(**changes) -> Profile:
    fields = yaml.safe_load((SEED_DIR / "cpu-demo.yaml").read_text())
    return Profile(**{**fields, **changes}, content_hash="h", created_by="test")


def test_the_process_driver_hands_the_engine_its_gpus_and_mode(tmp_path):
    profile = _profile(tensor_parallel_size=2, attention="tensor-parallel", gpus=[1, 0])
    args = engine_args(profile, tmp_path, "127.0.0.1", free_port())
    log_path = tmp_path / "run.log"
    handle = ProcessDriver(free_port()).launch(EngineCommand(1, "p", "h", args, engine_env(profile)), log_path)
    try:
        environ = dict(
            entry.split("=", 1) for entry in Path(f"/proc/{handle.pid}/environ").read_text().split("\0") if "=" in entry
        )
        argv = Path(f"/proc/{handle.pid}/cmdline").read_text().split("\0")
    finally:
        handle.terminate(0)
    assert environ["CUDA_VISIBLE_DEVICES"] == "1,0" and environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert argv[1:4] == ["-m", "engine", "serve"]
    assert (
        argv[argv.index("--attention") + 1] == "tensor-parallel"
        and argv[argv.index("--tensor-parallel-size") + 1] == "2"
    )


def test_the_process_driver_leaves_the_environment_alone_without_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    profile = _profile()
    args = engine_args(profile, tmp_path, "127.0.0.1", free_port())
    handle = ProcessDriver(free_port()).launch(EngineCommand(1, "p", "h", args, engine_env(profile)), tmp_path / "l")
    try:
        environ = Path(f"/proc/{handle.pid}/environ").read_text().split("\0")
    finally:
        handle.terminate(0)
    assert "CUDA_VISIBLE_DEVICES=3" in environ and not any(e.startswith("CUDA_DEVICE_ORDER=") for e in environ)


def test_the_docker_driver_hands_the_gpus_over_with_the_profile(tmp_path):
    settings = load_settings({"FLASHGATE_DATA_DIR": str(tmp_path)})
    profile = _profile(tensor_parallel_size=2, gpus=[2, 3])
    command = EngineCommand(5, "p", "h", engine_args(profile, tmp_path, "0.0.0.0", 30000), engine_env(profile))
    DockerDriver(settings)._hand_over(command)
    handoff = json.loads(settings.engine_handoff_path.read_text())
    assert handoff["env"] == {"CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert handoff["args"][handoff["args"].index("--attention") + 1] == "data-parallel"


def test_a_database_from_before_attention_and_gpus_keeps_its_profiles(make_app, data_dir, admin):
    """Schema version 5, a profile row as it was then (no attention, no gpus): the console migrates it and the
    profile reads with the defaults and its content hash, which a rehash of its settings still gives."""
    data_dir.mkdir(parents=True)
    old = create_db_engine(data_dir / "flashgate.sqlite3")
    assert migrate(old, MIGRATIONS[:5]) == 5
    fields = yaml.safe_load((SEED_DIR / "maxseq16-128k.yaml").read_text())
    columns = [c for c in fields if c != "engine_extras"]
    with old.begin() as conn:
        conn.exec_driver_sql(
            f"INSERT INTO profile ({', '.join(columns)}, engine_extras, content_hash, created_at, created_by, retired) "
            f"VALUES ({', '.join('?' for _ in columns)}, '{{}}', ?, '2026-11-01 00:00:00', 'seed', 0)",
            (*(fields[c] for c in columns), FIELD_128K_HASH),
        )
    old.dispose()
    with TestClient(make_app()) as client:
        profile = client.get("/api/profiles/maxseq16-128k", headers=admin).json()
        assert (profile["attention"], profile["gpus"]) == ("data-parallel", None)
        assert profile["content_hash"] == FIELD_128K_HASH and profile["created_at"].startswith("2026-11-01")
        # The new seeds arrive beside it.
        assert client.get("/api/profiles/flash-4gpu-tp-1m", headers=admin).status_code == 200
    with Session(create_db_engine(data_dir / "flashgate.sqlite3")) as session:
        row = session.get(Profile, 1)
        assert content_hash(settings_of(row)) == row.content_hash == FIELD_128K_HASH
