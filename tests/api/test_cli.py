"""`python -m engine serve` flags come from EngineConfig itself, so no field can be forgotten."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from engine import EngineConfig
from engine.server.cli import build_parser


def test_every_engine_config_field_is_a_flag_with_help():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {action.dest: action for action in serve._actions if action.dest not in ("help", "help_json")}
    assert set(flags) == set(EngineConfig.field_names())
    for field in dataclasses.fields(EngineConfig):
        assert flags[field.name].help and flags[field.name].option_strings[0] == "--" + field.name.replace("_", "-")


def test_flags_parse_into_the_config_and_default_to_loopback():
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--num-kv-pages", "12", "--request-timeout-s", "2.5", "--no-quant-sim"]
    )
    config = EngineConfig(**{name: getattr(args, name) for name in EngineConfig.field_names()})
    assert (config.num_kv_pages, config.request_timeout_s, config.quant_sim) == (12, 2.5, False)
    assert config.host == "127.0.0.1" and config.port == 30000 and config.context_length is None
    explicit_none = build_parser().parse_args(["serve", "--model", "m", "--context-length", "none"])
    assert explicit_none.context_length is None


def test_a_bad_flag_value_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--max-num-seqs", "many"])
    assert "--max-num-seqs" in capsys.readouterr().err


def test_no_flag_is_abbreviated(capsys):
    # `--mod /tmp/elsewhere` (a profile's extra) was taken for `--model`: weights from outside the models directory.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--mod", "/tmp/elsewhere"])
    assert "unrecognized arguments: --mod" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--mod", "m"])


def test_the_options_are_published_as_json_for_programs_that_drive_the_engine():
    """`python -m engine serve --help-json`: what the console checks a profile's extras against, without importing
    the engine."""
    out = subprocess.run(
        [sys.executable, "-m", "engine", "serve", "--help-json"], capture_output=True, text=True, check=True
    )
    published = json.loads(out.stdout)
    assert published["command"] == "serve"
    options = {o["name"]: o for o in published["options"]}
    assert list(options) == EngineConfig.field_names()
    assert options["model"] == {
        "name": "model",
        "flag": "--model",
        "type": "str",
        "nullable": False,
        "required": True,
        "default": None,
        "help": options["model"]["help"],
    }
    assert options["context_length"]["type"] == "int" and options["context_length"]["nullable"]
    assert options["quant_sim"]["type"] == "bool" and options["shutdown_grace_s"]["type"] == "float"
    # Every published option parses as published: the flag, its type, `none` where nullable.
    for option in published["options"]:
        argv = ["serve", "--model", "m"]
        if option["type"] == "bool":
            argv.append(option["flag"])
        elif option["name"] != "model":
            argv += [
                option["flag"],
                "none" if option["nullable"] else {"int": "3", "float": "0.5", "str": "x"}[option["type"]],
            ]
        args = build_parser().parse_args(argv)
        assert hasattr(args, option["name"])
