"""Console pages for profiles: the list, one profile with its diff against the parent, make a child, retire."""

from __future__ import annotations

import json
from typing import Any

from litestar import Controller, Response, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, URLEncodedBody
from litestar.plugins.htmx import HTMXRequest
from litestar.response import Template
from litestar.status_codes import HTTP_200_OK

from app.auth.guards import requires_operator, requires_viewer
from app.console import redirect
from app.errors import FieldError, InvalidFields
from app.profiles.controller import provide_profile_service
from app.profiles.schemas import (
    ATTENTION_MODES,
    ATTENTION_TRADES,
    DTYPES,
    KV_CACHE_DTYPES,
    SETTINGS,
    ProfileChildCreate,
    ProfileRead,
)
from app.profiles.service import NameTaken, ProfileService

# Each setting on a form in words: its label, its unit, and what bounds it (the API's field name is shown too).
SETTING_LABELS: dict[str, tuple[str, str, str]] = {
    "model": ("Model folder", "", "a folder under the models directory (FLASHGATE_MODELS_DIR)"),
    "revision": ("Weights revision", "", "optional: the checkpoint's revision, for the record"),
    "dtype": ("Weights data type", "", "auto reads it from the checkpoint"),
    "context_length": ("Context length", "tokens", "prompt plus answer of one request; at most the model's maximum"),
    "max_num_batched_tokens": ("Tokens per step", "tokens", "prefill budget of one step; at least the sequences"),
    "max_num_seqs": ("Concurrent sequences", "requests", "requests decoding at once"),
    "gpu_memory_utilization": ("GPU memory share", "fraction", "of each GPU's memory the engine may take; 0 to 1"),
    "kv_cache_dtype": ("KV cache data type", "", "fp8_e4m3 halves the cache per token"),
    "cuda_graph_max_bs": (
        "CUDA graph batch limit",
        "sequences",
        "largest decode batch captured; at most the sequences",
    ),
    "tensor_parallel_size": ("GPUs per engine", "GPUs", "one engine process per GPU; at most the GPUs this host has"),
    "attention": (
        "Attention across GPUs",
        "",
        "data-parallel: capacity and throughput; tensor-parallel: one request's latency",
    ),
    "gpus": ("Which GPUs", "GPU indices", "as nvidia-smi numbers them, one per GPU, e.g. 0,1; empty: the first ones"),
    "max_output_tokens": ("Route's answer limit", "tokens", "the route clamps max_tokens to it; at most the context"),
    "engine_extras": ("Engine extras", "JSON object", "further engine options by name"),
}

INT_SETTINGS = {"context_length", "max_num_batched_tokens", "max_num_seqs", "cuda_graph_max_bs"}
INT_SETTINGS |= {"tensor_parallel_size", "max_output_tokens"}


def gpus_words(gpus: list[int] | None) -> str:
    """`gpus` as the form shows it: "0,1", or empty for none named."""
    return "" if gpus is None else ",".join(str(i) for i in gpus)


def _form_values(profile: ProfileRead) -> dict[str, str]:
    values = {f: "" if getattr(profile, f) is None else str(getattr(profile, f)) for f in SETTINGS}
    values["engine_extras"] = json.dumps(profile.engine_extras, sort_keys=True)
    values["gpus"] = gpus_words(profile.gpus)
    return values


def _parse(field: str, raw: str) -> Any:
    """One form field to its setting's type; ValueError names the field and what it needs."""
    if field in INT_SETTINGS:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{field} must be a whole number, got {raw!r}") from None
    if field == "gpu_memory_utilization":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{field} must be a number between 0 and 1, got {raw!r}") from None
    if field == "engine_extras":
        try:
            value = json.loads(raw or "{}")
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f'engine_extras must be a JSON object such as {{"key": "value"}}, got {raw!r}')
        return value
    if field == "gpus":
        parts = [part.strip() for part in raw.replace(" ", ",").split(",") if part.strip()]
        if not all(part.isdigit() for part in parts):
            raise ValueError(
                f"gpus must be GPU indices separated by commas, such as 0,1 (empty: the first tensor_parallel_size "
                f"GPUs), got {raw!r}"
            )
        return [int(part) for part in parts] or None
    if field == "revision":
        return raw or None
    return raw


def child_request(form: dict[str, str], parent: ProfileRead) -> tuple[ProfileChildCreate, list[FieldError]]:
    """The make-child form as the API's request: only the settings that differ from the parent are changes (a field
    left out of the form keeps the parent's value). A value that cannot be read keeps the parent's too and comes back
    as an error of its own, so the service still checks every other field and the form shows all errors at once."""
    changes, unreadable = {}, []
    for field in (f for f in SETTINGS if f in form):
        try:
            value = _parse(field, form[field].strip())
        except ValueError as exc:
            unreadable.append(FieldError(field, str(exc)))
            continue
        if value != getattr(parent, field):
            changes[field] = value
    request = ProfileChildCreate(name=form.get("name", "").strip(), rationale=form.get("rationale", ""), **changes)
    return request, unreadable


class ProfilePages(Controller):
    guards = [requires_viewer]
    dependencies = {"profiles": Provide(provide_profile_service, sync_to_thread=False)}

    @get("/profiles", sync_to_thread=True)
    def list_page(self, profiles: NamedDependency[ProfileService]) -> Template:
        return Template("profiles/list.html", context={"profiles": profiles.read_all()})

    @get("/profiles/{name:str}", sync_to_thread=True)
    def detail_page(self, profiles: NamedDependency[ProfileService], name: FromPath[str]) -> Template:
        page = profiles.facts.page(profiles.session, profiles.get(name))
        context = {"profile": profiles.read_one(name), "trades": ATTENTION_TRADES, "host_gpus": profiles.host_gpus}
        return Template("profiles/detail.html", context=context | page)

    @get("/profiles/{name:str}/child", guards=[requires_operator], sync_to_thread=True)
    def child_page(self, profiles: NamedDependency[ProfileService], name: FromPath[str]) -> Template:
        parent = profiles.read_one(name)
        return Template("profiles/child.html", context=self._form_context(parent, _form_values(parent), []))

    @post("/profiles/{name:str}/children", guards=[requires_operator], status_code=HTTP_200_OK, sync_to_thread=True)
    def create_child(
        self,
        request: HTMXRequest,
        profiles: NamedDependency[ProfileService],
        name: FromPath[str],
        data: URLEncodedBody[dict[str, str]],
    ) -> Response:
        parent = profiles.read_one(name)
        try:
            child = profiles.create_child(request.user.name, name, *child_request(data, parent))
        except (InvalidFields, NameTaken) as exc:
            # Re-render with every error beside its input; htmx swaps just the form, a plain post gets the page.
            errors = exc.errors if isinstance(exc, InvalidFields) else [FieldError(exc.field, exc.detail)]
            context = self._form_context(parent, {**_form_values(parent), **data}, errors)
            template = "profiles/_child_form.html" if request.htmx else "profiles/child.html"
            return Template(template, context=context, status_code=exc.status_code)
        return redirect(request, f"/profiles/{child.name}")

    @post("/profiles/{name:str}/retire", guards=[requires_operator], status_code=HTTP_200_OK, sync_to_thread=True)
    def retire(self, request: HTMXRequest, profiles: NamedDependency[ProfileService], name: FromPath[str]) -> Response:
        profiles.retire(request.user.name, name)
        return redirect(request, f"/profiles/{name}")

    @staticmethod
    def _form_context(parent: ProfileRead, values: dict[str, str], errors: list[FieldError]) -> dict[str, Any]:
        return {
            "parent": parent,
            "values": values,
            "errors": {e.field: e.message for e in errors},
            "settings": SETTINGS,
            "labels": SETTING_LABELS,
            "choices": {"dtype": DTYPES, "kv_cache_dtype": KV_CACHE_DTYPES, "attention": ATTENTION_MODES},
        }
