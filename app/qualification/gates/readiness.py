"""Readiness: the engine came up, in how long, and with what it reports."""

from __future__ import annotations

from typing import Any

from app.qualification.gates.base import Gate, GateContext, LadderPlan, Verdict, verdict_of


class Readiness(Gate):
    name, title, kind = "readiness", "Readiness and identity", "structural"
    pass_rule = (
        "/health answers 200; /v1/models lists exactly the profile's served id; /server_info applies the profile's "
        "context_length, max_num_seqs and max_num_batched_tokens and reports a KV capacity"
    )
    measurements = ("load_seconds", "boot_stages", "build", "kv_capacity_tokens", "max_concurrency_at_full_context")

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {
            "served_model": plan.served_model,
            "limits": {
                "context_length": plan.context_length,
                "max_num_seqs": plan.max_num_seqs,
                "max_num_batched_tokens": plan.max_num_batched_tokens,
            },
        }

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        health = ctx.record(ctx.client.get("health", "/health"))
        models = ctx.record(ctx.client.get("models", "/v1/models"))
        info = ctx.record(ctx.client.get("server_info", "/server_info"))
        problems = [] if health.status == 200 else [f"/health: {health.outcome()}"]
        ids = [m.get("id") for m in models.body.get("data", [])] if models.ok and isinstance(models.body, dict) else []
        if ids != [inputs["served_model"]]:
            problems.append(f"/v1/models lists {ids}, not exactly [{inputs['served_model']!r}]")
        body = info.body if info.ok and isinstance(info.body, dict) else {}
        config = body.get("config") or {}
        for key, wanted in inputs["limits"].items():
            if config.get(key) != wanted:
                problems.append(f"/server_info config.{key} is {config.get(key)!r}, the profile says {wanted}")
        capacity = body.get("kv_capacity_tokens")
        if not isinstance(capacity, int) or capacity < 1:
            problems.append(f"/server_info kv_capacity_tokens is {capacity!r}")
        memory = body.get("gpu_memory") or {}
        measurements = {
            "load_seconds": ctx.boot.get("load_seconds"),
            "boot_stages": ctx.boot.get("boot_stages"),
            "build": body.get("build"),
            "served_ids": ids,
            "kv_capacity_tokens": capacity,
            "max_concurrency_at_full_context": body.get("max_concurrency_at_full_context"),
            "weights_bytes": memory.get("weights_bytes"),
            "kv_bytes": memory.get("kv_bytes"),
            "graph_bytes": memory.get("graph_bytes"),
        }
        ctx.sample_vram("idle")
        load = measurements["load_seconds"]
        passed = (
            f"ready{f' after {load:.1f} s' if load is not None else ''}: serves {inputs['served_model']!r}, build "
            f"{body.get('build')}, KV capacity {capacity:,} tokens"
            if isinstance(capacity, int)
            else ""
        )
        return verdict_of(problems, passed, measurements)
