"""Every state change leaves an audit row (who, what, when, before/after) in the same transaction; each request
has an id, returned as X-Request-ID and recorded with the rows it caused."""

from __future__ import annotations


def test_each_state_change_is_an_audit_row(client, admin, bearer, operator_token, sign_in, page_csrf):
    start = client.get("/api/audit", headers=admin).json()[0]["id"]
    otto = bearer(operator_token("otto", "operator"))
    client.post(
        "/api/profiles",
        json={
            "name": "tiny-root",
            "model": "tiny",
            "context_length": 2048,
            "max_num_batched_tokens": 256,
            "max_num_seqs": 2,
            "cuda_graph_max_bs": 1,
            "max_output_tokens": 128,
        },
        headers=otto,
    )
    client.post(
        "/api/profiles/tiny-root/children",
        json={"name": "tiny-1k", "rationale": "r", "context_length": 1024},
        headers=otto,
    )
    client.patch("/api/profiles/tiny-1k", json={"max_output_tokens": 64}, headers=otto)
    client.post("/api/profiles/tiny-1k/retire", headers=otto)
    token = client.post("/api/operators/otto/tokens", json={"name": "ci"}, headers=otto).json()
    client.delete(f"/api/tokens/{token['id']}", headers=otto)
    sign_in("olga", operator_token("olga", "operator"))
    client.post("/signout", data={"_csrf_token": page_csrf(client, "/profiles")})

    rows = [r for r in client.get("/api/audit", params={"limit": 1000}, headers=admin).json() if r["id"] > start]
    got = [(r["actor"], r["action"], r["target"]) for r in reversed(rows)]
    assert got == [
        ("admin", "operator.create", "operator:otto"),
        ("admin", "token.create", got[1][2]),
        ("otto", "profile.create", "profile:tiny-root"),
        ("otto", "profile.create_child", "profile:tiny-1k"),
        ("otto", "profile.update", "profile:tiny-1k"),
        ("otto", "profile.retire", "profile:tiny-1k"),
        ("otto", "token.create", f"token:{token['id']}"),
        ("otto", "token.revoke", f"token:{token['id']}"),
        ("admin", "operator.create", "operator:olga"),
        ("admin", "token.create", got[9][2]),
        ("olga", "operator.sign_in", "operator:olga"),
        ("olga", "operator.sign_out", "operator:olga"),
    ]
    update = next(r for r in rows if r["action"] == "profile.update")
    assert update["before"]["max_output_tokens"] == 128 and update["after"]["max_output_tokens"] == 64
    assert update["before"]["content_hash"] == update["after"]["content_hash"]  # the clamp is not engine content
    child = next(r for r in rows if r["action"] == "profile.create_child")
    assert (
        child["before"] is None and child["after"]["parent"] == "tiny-root" and child["after"]["context_length"] == 1024
    )
    assert all(r["at"] and r["request_id"] for r in rows)


def test_refused_requests_leave_no_audit_row(client, operator, admin):
    before = client.get("/api/audit", headers=admin).json()[0]["id"]
    client.post(
        "/api/profiles/cpu-demo/children", json={"name": "x", "rationale": "", "max_num_seqs": 0}, headers=operator
    )
    client.post("/api/profiles/nope/retire", headers=operator)
    assert client.get("/api/audit", headers=admin).json()[0]["id"] == before


def test_audit_filters_and_needs_a_viewer(client, viewer, operator):
    client.post("/api/profiles/maxseq1-1m/retire", headers=operator)
    rows = client.get("/api/audit", params={"target": "profile:maxseq1-1m"}, headers=viewer).json()
    assert [(r["action"], r["before"], r["after"]) for r in rows] == [
        ("profile.retire", {"retired": False}, {"retired": True}),
        ("profile.seed", None, rows[1]["after"]),
    ]
    assert client.get("/api/audit", params={"action": "profile.retire"}, headers=viewer).json()[0]["actor"] == "otto"
    assert client.get("/api/audit").status_code == 401
    assert client.get("/api/audit", params={"limit": 0}, headers=viewer).status_code == 400


def test_request_id_is_returned_and_recorded(client, operator, admin):
    response = client.post("/api/profiles/maxseq4-1m/retire", headers={**operator, "X-Request-ID": "req-42"})
    assert response.headers["x-request-id"] == "req-42"
    (row,) = client.get("/api/audit", params={"action": "profile.retire"}, headers=admin).json()
    assert row["request_id"] == "req-42"
    generated = client.get("/healthz", headers={"X-Request-ID": "not a valid id!"}).headers["x-request-id"]
    assert len(generated) == 32 and generated != client.get("/healthz").headers["x-request-id"]
