"""The server-rendered console: profile list, detail with the diff against the parent, the make-child form with
errors inline beside their fields (htmx and plain posts), retire, audit; htmx is served from our own static files."""

from __future__ import annotations

import sqlite3

import pytest

HTMX = {"HX-Request": "true"}


@pytest.fixture
def otto(client, operator_token, sign_in) -> str:
    """A signed-in operator; returns a CSRF token for the forms."""
    return sign_in("otto", operator_token("otto", "operator"))


def profile_count(data_dir) -> int:
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        return conn.execute("SELECT count(*) FROM profile").fetchone()[0]


def test_list_shows_every_profile_with_its_state(client, otto):
    page = client.get("/profiles")
    assert page.status_code == 200
    for name in ("cpu-demo", "maxseq16-128k", "maxseq16-650k", "maxseq1-1m", "maxseq4-1m", "maxseq16-1m"):
        assert f'href="/profiles/{name}"' in page.text
    assert "weights missing" in page.text and "more GPUs than this host has" in page.text
    assert "tensor-parallel" in page.text  # the mode beside a multi-GPU profile's GPU count
    assert "1,000,000" in page.text
    assert '<a href="/profiles" aria-current="page">Profiles</a>' in page.text


def test_make_a_child_through_the_form_with_htmx(client, otto, data_dir):
    form = client.get("/profiles/cpu-demo/child")
    assert form.status_code == 200 and 'hx-post="/profiles/cpu-demo/children"' in form.text
    assert 'name="context_length" value="4096"' in form.text

    values = {
        "_csrf_token": otto,
        "name": "cpu-demo-2k",
        "rationale": "half the context",
        "model": "demo",
        "revision": "",
        "dtype": "float32",
        "context_length": "2048",
        "max_num_batched_tokens": "512",
        "max_num_seqs": "4",
        "gpu_memory_utilization": "0.5",
        "kv_cache_dtype": "auto",
        "cuda_graph_max_bs": "1",
        "tensor_parallel_size": "1",
        "max_output_tokens": "256",
        "engine_extras": "{}",
    }
    created = client.post("/profiles/cpu-demo/children", data=values, headers=HTMX)
    assert created.status_code == 200 and created.headers["hx-redirect"] == "/profiles/cpu-demo-2k"
    detail = client.get("/profiles/cpu-demo-2k")
    assert "Changes from" in detail.text and "<code>context_length</code>" in detail.text
    assert 'class="before">4096' in detail.text and 'class="after">2048' in detail.text
    assert "settings differ from the parent" not in detail.text
    assert 'href="/profiles/cpu-demo-2k"' in client.get("/profiles").text


def test_form_errors_are_inline_beside_their_fields_and_write_nothing(client, otto, data_dir):
    before = profile_count(data_dir)
    values = {
        "_csrf_token": otto,
        "name": "cpu-demo-bad",
        "rationale": "",
        "max_num_seqs": "8",
        "max_num_batched_tokens": "4",
        "cuda_graph_max_bs": "9",
    }
    response = client.post("/profiles/cpu-demo/children", data=values, headers=HTMX)
    assert response.status_code == 422
    assert response.text.lstrip().startswith('<form id="child-form"')  # the partial only: htmx swaps the form
    assert 'id="error-rationale">rationale is required' in response.text
    assert (
        'id="error-max_num_batched_tokens">max_num_batched_tokens must be at least max_num_seqs (8), got 4'
        in response.text
    )
    assert 'id="error-cuda_graph_max_bs">cuda_graph_max_bs must be at most max_num_seqs (8), got 9' in response.text
    assert 'value="cpu-demo-bad"' in response.text  # what was typed stays
    not_a_number = client.post(
        "/profiles/cpu-demo/children", data={**values, "rationale": "r", "context_length": "lots"}, headers=HTMX
    )
    assert not_a_number.status_code == 422
    assert "context_length must be a whole number, got &#39;lots&#39;" in not_a_number.text
    assert profile_count(data_dir) == before


def test_plain_form_posts_work_without_javascript(client, otto):
    values = {"_csrf_token": otto, "name": "cpu-demo-seq2", "rationale": "two at once", "max_num_seqs": "2"}
    values |= {"max_output_tokens": "128"}
    created = client.post("/profiles/cpu-demo/children", data=values, follow_redirects=False)
    assert created.status_code == 303 and created.headers["location"] == "/profiles/cpu-demo-seq2"
    detail = client.get("/profiles/cpu-demo-seq2")
    assert "2 settings differ from the parent (max_num_seqs, max_output_tokens)" in detail.text
    invalid = client.post("/profiles/cpu-demo/children", data={**values, "name": "BAD"})
    assert invalid.status_code == 422 and "<title>Make a child of cpu-demo" in invalid.text
    assert 'id="error-name">name must be a lowercase slug' in invalid.text


def test_retire_from_the_detail_page(client, otto):
    detail = client.get("/profiles/maxseq1-1m")
    assert 'hx-post="/profiles/maxseq1-1m/retire"' in detail.text and "hx-confirm" in detail.text
    retired = client.post("/profiles/maxseq1-1m/retire", data={"_csrf_token": otto}, headers=HTMX)
    assert retired.headers["hx-redirect"] == "/profiles/maxseq1-1m"
    page = client.get("/profiles/maxseq1-1m")
    assert '<span class="badge muted">retired</span>' in page.text and ">Retire</button>" not in page.text
    again = client.post("/profiles/maxseq1-1m/retire", data={"_csrf_token": otto}, headers=HTMX)
    assert again.status_code == 409 and again.headers["hx-retarget"] == "#notice"
    assert "already retired" in again.text


def test_viewers_see_no_actions(client, operator_token, sign_in):
    sign_in("vera", operator_token("vera", "viewer"))
    page = client.get("/profiles/cpu-demo")
    assert page.status_code == 200 and "Make a child" not in page.text and ">Retire<" not in page.text
    assert client.get("/profiles/cpu-demo/child").status_code == 403


def test_unknown_profile_page_is_404(client, otto):
    response = client.get("/profiles/nope")
    assert response.status_code == 404 and "no profile named &#39;nope&#39;" in response.text


def test_audit_page(client, otto):
    client.post("/profiles/maxseq4-1m/retire", data={"_csrf_token": otto})
    page = client.get("/audit")
    assert page.status_code == 200 and "profile.retire" in page.text and "profile:maxseq4-1m" in page.text
    filtered = client.get("/audit", params={"target": "profile:maxseq4-1m"})
    assert "profile:cpu-demo" not in filtered.text


def test_htmx_is_vendored(client):
    script = client.get("/static/htmx.min.js")
    assert script.status_code == 200 and "htmx" in script.text[:200]
    assert client.get("/static/console.css").status_code == 200
    assert "unpkg" not in client.get("/signin").text and "cdn" not in client.get("/signin").text
