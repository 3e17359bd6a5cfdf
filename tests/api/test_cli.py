"""`python -m engine serve` flags come from EngineConfig itself, so no field can be forgotten."""

from __future__ import annotations

import dataclasses

import pytest

from engine import EngineConfig
from engine.server.cli import build_parser


def test_every_engine_config_field_is_a_flag_with_help():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {action.dest: action for action in serve._actions if action.dest != "help"}
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
