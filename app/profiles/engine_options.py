"""The engine's `serve` options as the engine itself publishes them (`python -m engine serve --help-json`), read once
per console process, so a profile's engine extras are checked against the engine's real flags without the console
importing the engine. An extra must be an engine option the profile and the console do not set, named exactly (the
engine takes no abbreviation, and `=` in a key would smuggle a value into the flag), with a value of its type."""

from __future__ import annotations

import contextlib
import functools
import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from app.errors import FieldError

HELP_JSON = [sys.executable, "-m", "engine", "serve", "--help-json"]
READ_TIMEOUT_S = 120.0
# What the console sets on every engine command line itself (app/engine_control/driver.py: engine_args).
CONSOLE_FLAGS = ("served_model_name", "host", "port")
VALUE_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,)}
VALUE_WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}


class EngineOptionsUnavailable(RuntimeError):
    """The engine could not say what options it takes."""


@dataclass(frozen=True)
class EngineOption:
    name: str
    flag: str
    type: str  # bool, int, float or str
    nullable: bool

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if self.type == "bool" or isinstance(value, bool):  # a bool is an int to Python, not to the engine
            return self.type == "bool" and isinstance(value, bool)
        return isinstance(value, VALUE_TYPES[self.type])


_asking = threading.Lock()


def engine_options() -> dict[str, EngineOption]:
    """The engine's options by name, asked of the engine once per process; one asks at a time (each asking starts
    the engine's imports, seconds of CPU), and a failure is not kept: the next check asks again."""
    with _asking:
        return _ask_engine()


@functools.cache
def _ask_engine() -> dict[str, EngineOption]:
    try:
        out = subprocess.run(HELP_JSON, capture_output=True, text=True, timeout=READ_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineOptionsUnavailable(f"{' '.join(HELP_JSON[1:])} did not answer: {exc}") from exc
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["no output"]
        raise EngineOptionsUnavailable(f"{' '.join(HELP_JSON[1:])} exited with {out.returncode}: {tail[0]}")
    published = json.loads(out.stdout)["options"]
    return {o["name"]: EngineOption(o["name"], o["flag"], o["type"], o["nullable"]) for o in published}


def warm_engine_options() -> None:
    """Ask the engine now (the console does at its start, in the background), so the first write with extras need
    not wait for the engine's seconds of start-up."""
    with contextlib.suppress(EngineOptionsUnavailable):  # said as a field error if the extras need them
        engine_options()


def extras_errors(extras: dict[str, Any], profile_fields: tuple[str, ...]) -> list[FieldError]:
    """Each extra that is not an engine option, that sets what the profile or the console sets, whose key holds `=`,
    or whose value is not of the option's type."""
    if not extras:
        return []
    try:
        options = engine_options()
    except EngineOptionsUnavailable as exc:
        return [FieldError("engine_extras", f"engine_extras cannot be checked: {exc}")]
    errors = []
    for key, value in sorted(extras.items()):
        field = f"engine_extras.{key}"
        option = options.get(key)
        if "=" in key:
            errors.append(FieldError(field, f"{field}: a key must not hold '=' (got {key!r})"))
        elif key in profile_fields:
            errors.append(FieldError(field, f"{field}: {key} is a profile field; set it as a setting, not an extra"))
        elif key in CONSOLE_FLAGS:
            errors.append(FieldError(field, f"{field}: the console sets {key} itself"))
        elif option is None:
            named = options.get(key.replace("-", "_").removeprefix("__"))
            hint = f"; did you mean {named.name!r}?" if named else " (python -m engine serve --help-json lists them)"
            errors.append(FieldError(field, f"{field}: {key!r} is not an engine option{hint}"))
        elif not option.accepts(value):
            what = VALUE_WORDS[option.type] + (" or null" if option.nullable else "")
            errors.append(FieldError(field, f"{field} must be {what} ({option.flag}), got {value!r}"))
    return errors
