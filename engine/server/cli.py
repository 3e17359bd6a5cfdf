"""`python -m engine serve`: a flag for every EngineConfig field, then boot (weights, kv_alloc, graph_capture as JSON
`boot_stage` events), the ready line on stdout, and the HTTP server until SIGTERM.

The port is bound before the weights load, so a taken port fails in a second, but it listens only once the engine
is ready: until then connections are refused. SIGTERM (or Ctrl-C) stops admitting (503), lets in-flight requests
finish for `shutdown_grace_s`, aborts the rest, releases the GPU and exits 0; a second signal exits at once. Any
failure to start is a `failed` boot stage and a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import socket
import time
import types
import typing

import structlog
import uvicorn

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.logging import configure_logging
from engine.server.app import Served, create_app
from engine.server.engine_loop import EngineLoop
from engine.server.grammar import Grammars
from engine.server.info import build_id, capabilities, models, ready_line, server_info
from engine.server.metrics import Metrics
from engine.server.protocol import Limits

log = structlog.get_logger("engine.server")
DRAIN_POLL_S = 0.05
ABORT_WAIT_S = 5.0  # after aborting, how long responses get to say so before connections close


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: `--mod` must not be taken for `--model` (a console passes profile extras through as flags).
    parser = argparse.ArgumentParser(
        prog="python -m engine", description="Flashgate's DeepSeek-V4 engine", allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API over HTTP", allow_abbrev=False)
    serve.add_argument(
        "--help-json",
        action=_PrintOptions,
        help="print the serve options as JSON (name, flag, type, nullable, required, default, help) and exit",
    )
    for option in serve_options():
        flag, help_text = option["flag"], option["help"]
        if option["type"] == "bool":
            serve.add_argument(flag, action=argparse.BooleanOptionalAction, default=option["default"], help=help_text)
        elif option["required"]:
            serve.add_argument(flag, type=_TYPES[option["type"]], required=True, help=help_text)
        else:
            base = _TYPES[option["type"]]
            parse = _or_none(base) if option["nullable"] else base
            shown = "" if option["default"] is None else f" [{option['default']}]"
            serve.add_argument(flag, type=parse, default=option["default"], help=help_text + shown)
    return parser


_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}


def serve_options() -> list[dict[str, typing.Any]]:
    """`serve`'s options, one per EngineConfig field: what `--help-json` publishes, so that a program driving the
    engine (the console) checks its flags without importing it. `nullable`: the word `none` sets it unset."""
    hints = typing.get_type_hints(EngineConfig)
    options = []
    for field in dataclasses.fields(EngineConfig):
        kind = hints[field.name]
        members = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
        base = next(t for t in members if t is not type(None))
        required = field.default is dataclasses.MISSING
        options.append(
            {
                "name": field.name,
                "flag": "--" + field.name.replace("_", "-"),
                "type": base.__name__,
                "nullable": type(None) in members,
                "required": required,
                "default": None if required else field.default,
                "help": field.metadata["help"],
            }
        )
    return options


class _PrintOptions(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: typing.Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(json.dumps({"command": "serve", "options": serve_options()}, indent=1))
        parser.exit()


def _or_none(base: type) -> typing.Callable[[str], object]:
    def parse(text: str) -> object:
        return None if text.lower() == "none" else base(text)

    parse.__name__ = base.__name__  # argparse names the type in its errors
    return parse


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging()
    _route_std_logging()
    return serve(args)


def serve(args: argparse.Namespace) -> int:
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _stop_booting)
    try:
        config = EngineConfig(**{name: getattr(args, name) for name in EngineConfig.field_names()})
        sock = _bind(config.host, config.port)
        engine = LLMEngine(config)
        grammars = _grammars(engine)
        advertised = capabilities(engine, structured_output=grammars is not None)
        info = server_info(engine, build_id(), advertised)
    except _BootStopped:
        log.info("boot_stopped", seconds=_since(started))
        return 0
    except Exception as error:
        log.error(
            "boot_stage", stage="failed", seconds=_since(started), error=str(error), error_type=type(error).__name__
        )
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    metrics = Metrics()
    server: _Server | None = None

    def engine_failed(_: BaseException) -> None:
        if server is not None and server.loop is not None:
            server.loop.call_soon_threadsafe(server.stop_now)

    engine_loop = EngineLoop(engine, metrics, engine_failed)
    served = Served(
        loop=engine_loop,
        metrics=metrics,
        tokenizer=engine.tokenizer,
        limits=Limits(
            served_model_name=info["served_model_name"],
            context_length=engine.context_length,
            kv_capacity_tokens=engine.kv_capacity_tokens,
            vocab_size=engine.model_args.vocab_size,
        ),
        max_waiting_requests=config.max_waiting_requests,
        server_info=info,
        models=models(engine, advertised),
        grammars=grammars,
    )
    uvicorn_config = uvicorn.Config(
        create_app(served), log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=ABORT_WAIT_S
    )

    def ready() -> None:
        log.info("boot_stage", stage="ready", seconds=_since(started), host=config.host, port=config.port)
        print(ready_line(info), flush=True)

    server = _Server(uvicorn_config, served, config.shutdown_grace_s, ready)
    engine_loop.start()
    try:
        server.run(sockets=[sock])
    finally:
        engine_loop.stop()
        engine.close()
    log.info("engine_stopped", failed=server.failed)  # exiting gives the GPU's memory back
    return 1 if server.failed else 0


def _grammars(engine: LLMEngine) -> Grammars | None:
    """The output grammars' view of the vocabulary; without it the server answers unconstrained requests only."""
    try:
        return Grammars(engine.tokenizer, engine.model_args.vocab_size)
    except ValueError as error:
        log.warning("structured_output_unavailable", reason=str(error))
        return None


class _Server(uvicorn.Server):
    """uvicorn with the engine's shutdown: the first signal drains, a second one stops at once."""

    def __init__(self, config: uvicorn.Config, served: Served, grace_s: float, on_ready: typing.Callable[[], None]):
        super().__init__(config)
        self.served, self.grace_s, self.on_ready = served, grace_s, on_ready
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.failed = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            self.on_ready()

    def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
        if self.draining or self.loop is None:
            self.should_exit = self.force_exit = True
            return
        self.draining = True
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain(signal.Signals(sig).name)))

    def stop_now(self) -> None:
        self.failed = True
        self.served.accepting = False
        self.should_exit = True

    async def _drain(self, signal_name: str) -> None:
        engine_loop = self.served.loop
        self.served.accepting = False
        log.info("draining", signal=signal_name, in_flight=engine_loop.num_unfinished, grace_s=self.grace_s)
        deadline = time.monotonic() + self.grace_s
        while engine_loop.num_unfinished and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if engine_loop.num_unfinished:
            log.warning("drain_timeout", aborted=engine_loop.num_unfinished, grace_s=self.grace_s)
            engine_loop.abort_all()
            deadline = time.monotonic() + ABORT_WAIT_S
            while engine_loop.num_unfinished and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
        log.info("drained")
        self.should_exit = True


class _BootStopped(Exception):
    """SIGTERM arrived while the engine was still starting."""


def _stop_booting(sig: int, frame: types.FrameType | None) -> None:
    raise _BootStopped


def _bind(host: str, port: int) -> socket.socket:
    """Bind now (a taken port fails before the weights load); uvicorn listens on it once the engine is ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {error.strerror}") from error
    sock.set_inheritable(True)
    return sock


class _ToStructlog(logging.Handler):
    """uvicorn and the libraries log through `logging`; their warnings join the engine's JSON lines."""

    def emit(self, record: logging.LogRecord) -> None:
        structlog.get_logger(record.name).log(record.levelno, record.getMessage(), logger=record.name)


def _route_std_logging() -> None:
    root = logging.getLogger()
    root.handlers = [_ToStructlog()]
    root.setLevel(logging.WARNING)


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)
