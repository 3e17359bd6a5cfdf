"""Suite-wide rules: GPU tests skip without CUDA, and each marker has a time budget that the run enforces. And the
one fixture several folders share: the tiny checkpoint, made once per session."""

from __future__ import annotations

import collections
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import copy_demo_model

# Seconds of test time per marker for one CPU run (2 cores). "unmarked" is everything else. CI should stay under
# ~40 minutes; these budgets keep each part honest and make a slow new test fail loudly instead of creeping.
# "container" includes building the image (make image-cpu, cached layers after the first build in a run). On
# 2026-12-02 the 2-core machine ran the suite about 1.45x slower than the day before (unmarked 176 -> 290 s, slow
# 510 -> 731 s, pytest 24.7 min in all) while a sample test took no longer at HEAD than at the day-old commit in the
# same minute: the budgets leave room for such a machine. On 2026-12-02 (session 12) the suite grew by the multi-rank,
# prefix-cache and multi-GPU console tests: a clean-clone CI run took unmarked 331 s, slow 807 s, pytest 26 min. By
# 2026-12-03 the demo model's training and data tests had come in (1,811 tests): CI's run took pytest 30.7 min, all
# passing, and went red on a budget; the unmarked tests alone took 419 s here on an idle machine. A clean-clone run
# here then took unmarked 409 s, slow 1,197 s (the host-ops smoke run came in), pytest 37 min.
BUDGETS = {"unmarked": 540.0, "slow": 1400.0, "ranks": 300.0, "browser": 240.0, "gpu": 900.0, "container": 1200.0}

_spent: collections.Counter[str] = collections.Counter()


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton kernels run in Triton's interpreter. It must be chosen before any kernel module is imported
# (triton.jit decides at decoration time), hence here, before test modules import the engine.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _budget_key(item) -> str:
    for name in ("gpu", "container", "browser", "slow", "ranks"):
        if name in item.keywords:
            return name
    return "unmarked"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    _spent[_budget_key(item)] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = [f"{name}: {_spent[name]:.1f}s of {limit:.0f}s" for name, limit in BUDGETS.items() if _spent[name]]
    if lines:
        terminalreporter.write_sep("-", "time budgets per marker")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    over = {name: spent for name, spent in _spent.items() if spent > BUDGETS[name]}
    if over and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            for name, spent in over.items():
                reporter.write_line(f"TIME BUDGET EXCEEDED: {name} tests took {spent:.1f}s > {BUDGETS[name]:.0f}s")


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory) -> Path:
    """A models directory holding the tiny checkpoint, made once per session by the engine's own tool (a subprocess,
    as the console makes it)."""
    models = tmp_path_factory.mktemp("models")
    subprocess.run([sys.executable, "-m", "engine.tools.make_tiny", "--out", str(models / "tiny")], check=True)
    return models


@pytest.fixture(scope="session")
def demo_models_dir(tmp_path_factory) -> Path:
    """A models directory holding the shipped demo model as `demo`, as the console installs it on first start: what
    cpu-demo serves."""
    models = tmp_path_factory.mktemp("models")
    copy_demo_model(models)
    return models
