"""The Dockerfile read as data (tests/container/ builds it for real on CI's Debian 12 base; hadolint lints it in
`make lint`): a system stage on one chosen base that the build and runtime stages share, the base-specific
packages as build args (Ubuntu 24.04's by default, Debian 12's in the Makefile), an offline build from the
wheelhouse, torch pinned inside pyproject's bounds, a non-root user, the build id baked in from build args, the
console's healthcheck, /data as a volume, and a build context that holds what the image copies and nothing else."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    joined, pending = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1].strip()) for text in joined]


def args_defaults() -> dict[str, str]:
    found = {}
    for name, value in instructions():
        if name == "ARG" and "=" in value:
            key, default = value.split("=", 1)
            found[key] = default
    return found


def test_stages_share_one_system_stage_on_one_chosen_base():
    froms = [value for name, value in instructions() if name == "FROM"]
    assert froms == ["${BASE_IMAGE} AS system", "system AS build", "system AS runtime"]
    base = args_defaults()["BASE_IMAGE"]
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-runtime-ubuntu24\.04", base)
    # compose.yaml builds with the same default base.
    build_args = yaml.safe_load((ROOT / "compose.yaml").read_text())["x-build"]["args"]
    assert build_args["BASE_IMAGE"] == f"${{FLASHGATE_BASE_IMAGE:-{base}}}"


def test_torch_and_triton_pins_are_inside_the_project_bounds():
    defaults = args_defaults()
    requirements = {Requirement(r).name: Requirement(r) for r in PYPROJECT["dependencies"]}
    assert defaults["TORCH_VERSION"] == "2.11.0" and defaults["TORCH_VERSION"] in requirements["torch"].specifier
    assert defaults["TRITON_VERSION"] in requirements["triton"].specifier
    installs = " ".join(value for name, value in instructions() if name == "RUN")
    assert '"torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"' in installs
    assert "pip install --no-cache-dir --no-deps -e ." in installs


def _pins(packages: str) -> dict[str, str]:
    return dict(pin.split("=", 1) for pin in packages.split())


def test_system_packages_are_pinned_per_base_and_name_the_same_set():
    """Ubuntu 24.04's Python 3.12 by default; the Makefile's Debian 12 set (CI's base) is the same packages for its
    Python 3.11, each pinned to its release series."""
    defaults = args_defaults()
    ubuntu = _pins(defaults["SYSTEM_PACKAGES"].strip('"'))
    assert defaults["PYTHON"] == "python3.12"
    assert set(ubuntu) == {"python3.12", "python3.12-venv", "python3.12-dev", "gcc", "libc6-dev"}
    makefile = (ROOT / "Makefile").read_text().replace("\\\n\t", "")
    debian = _pins(re.search(r"^DEBIAN12_PACKAGES := (.+)$", makefile, re.MULTILINE).group(1))
    assert re.search(r"^DEBIAN12_PYTHON := python3\.11$", makefile, re.MULTILINE)
    assert {name.replace("3.11", "3.12") for name in debian} == set(ubuntu)
    for pins in (ubuntu, debian):
        assert all(version and version[0].isdigit() for version in pins.values()), pins
    system = " ".join(value for name, value in instructions() if name == "RUN")
    assert 'apt-get install -y --no-install-recommends "${missing[@]}"' in system


def test_wheelhouse_build_asks_no_index():
    """WHEELHOUSE=1 writes the build stage's pip settings: no index, the wheelhouse as the only source. CI's build
    (make image-cpu) uses it with no network at all, which proves every wheel is there."""
    assert args_defaults()["WHEELHOUSE"] == "0"
    runs = " ".join(value for name, value in instructions() if name == "RUN")
    assert "no-index = true\\nfind-links = /opt/wheelhouse" in runs and "/etc/pip.conf" in runs
    assert ("COPY", "wheelhouse /opt/wheelhouse") in instructions()
    image_cpu = (ROOT / "Makefile").read_text().split("\nimage-cpu:")[1].split("\n\n")[0]
    assert "--network none" in image_cpu and "--build-arg WHEELHOUSE=1" in image_cpu
    assert not (ROOT / "Dockerfile").read_text().startswith("# syntax=")  # BuildKit would pull its frontend


def test_non_root_user_volume_healthcheck_and_entrypoint():
    runtime = dict(_runtime_stage())
    assert runtime["USER"] == "10001:10001"
    assert "--uid 10001" in " ".join(v for n, v in _runtime_stage() if n == "RUN")
    assert json.loads(runtime["VOLUME"]) == ["/data"]
    assert runtime["EXPOSE"] == "8080"
    assert runtime["HEALTHCHECK"].endswith('CMD ["flashgate", "healthcheck"]')
    assert json.loads(runtime["ENTRYPOINT"]) == ["/opt/flashgate/bin/flashgate"]
    assert json.loads(runtime["CMD"]) == ["console"]
    env = runtime["ENV"]
    for setting in ("FLASHGATE_DATA_DIR=/data", "FLASHGATE_MODELS_DIR=/models", "FLASHGATE_HOST=0.0.0.0"):
        assert setting in env


def test_build_id_comes_from_build_args():
    defaults = args_defaults()
    assert defaults["FLASHGATE_VERSION"] == PYPROJECT["version"]
    assert defaults["FLASHGATE_COMMIT"] == "unknown"
    env = dict(_runtime_stage())["ENV"]
    assert 'FLASHGATE_BUILD="${FLASHGATE_VERSION}+${FLASHGATE_COMMIT}"' in env
    build_args = yaml.safe_load((ROOT / "compose.yaml").read_text())["x-build"]["args"]
    assert build_args["FLASHGATE_VERSION"] == f"${{FLASHGATE_VERSION:-{PYPROJECT['version']}}}"
    assert build_args["FLASHGATE_COMMIT"] == "${FLASHGATE_COMMIT:-unknown}"


def test_build_context_holds_what_the_image_copies():
    """.dockerignore is an allow-list: each COPY source is in it, and the local state (.venv, data, .git) is not."""
    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]

    def sent(path: str) -> bool:
        included = True
        for pattern in patterns:
            negate = pattern.startswith("!")
            bare = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, bare) or path.startswith(bare + "/"):
                included = negate
        return included

    copied = [
        source
        for name, value in instructions()
        if name == "COPY" and "--from" not in value
        for source in value.split()[:-1]
    ]
    assert copied and all(sent(source) and (ROOT / source).exists() for source in copied), copied
    for local in (".venv", "data", ".git", "tests", "bench", "test-artifacts", "engine/__pycache__/x.pyc"):
        assert not sent(local), local
    # What the console reads beside its package (app/main.py) is copied.
    assert {"pyproject.toml", "README.md", "app", "engine", "console", "profiles", "bin"} <= set(copied)
    assert {"wheelhouse", "deploy/requirements.py"} <= set(copied)


def _runtime_stage() -> list[tuple[str, str]]:
    steps = instructions()
    start = next(i for i, (name, value) in enumerate(steps) if name == "FROM" and value.endswith("AS runtime"))
    return steps[start:]
