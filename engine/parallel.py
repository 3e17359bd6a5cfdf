"""One engine over several GPUs of one host: one process per rank. The engine's main process is rank 0 — it runs the
HTTP server, the schedulers and sampling — and starts ranks 1 .. N-1 as child processes of its own
(`python -m engine rank`), each with the environment it was given (NCCL_* included) and the same
configuration. All join one torch.distributed group (NCCL on CUDA, gloo on the CPU) for the model's collectives,
and a gloo group beside it over which rank 0 sends each step's plans (engine/model_runner.py).

Failure ends the whole engine, never half of it: a rank that exits, or stops answering (its heartbeat, a byte on
a pipe every HEARTBEAT_S, silent for HUNG_S — SIGSTOP), is logged with what is known and rank 0 kills the other
ranks and exits non-zero, so the console's supervisor and watch see a crash. The ranks die with rank 0
(PR_SET_PDEATHSIG) and ignore SIGTERM and SIGINT: rank 0 stops them (`close`) once it has drained its requests.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist

from engine.config import EngineConfig

log = structlog.get_logger(__name__)
HEARTBEAT_S = 0.5
HUNG_S = 10.0
# How long rank 0 waits for the ranks to leave after telling them to stop, before it kills them.
STOP_WAIT_S = 10.0
# A collective that waits longer than this fails instead of hanging (the watchdog ends the engine sooner).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it ends, however it ends."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _backend(config: EngineConfig) -> str:
    cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


class RankGroup:
    """A rank's membership of the group: its rank and the group's size, the control channel from rank 0 (`send`,
    `receive`, `gather`) and, on rank 0, the other ranks' processes and their watchdog."""

    def __init__(self, rank: int, size: int, workdir: str, backend: str, workers: list[subprocess.Popen] = ()):
        self.rank, self.size, self.workdir, self.backend = rank, size, workdir, backend
        self.workers = list(workers)
        self.control = None
        self.closing = False

    @classmethod
    def start(cls, config: EngineConfig) -> RankGroup | None:
        """Rank 0: start ranks 1 .. N-1, watch them, and join the group with them (None when there is one rank)."""
        size = config.tensor_parallel_size
        if size == 1:
            return None
        workdir = tempfile.mkdtemp(prefix="flashgate-ranks-")
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(config), f)
        workers, beats = [], []
        for rank in range(1, size):
            read, write = os.pipe()
            command = [sys.executable, "-m", "engine", "rank", "--rank", str(rank), "--size", str(size),
                       "--dir", workdir, "--heartbeat-fd", str(write)]  # fmt: skip
            workers.append(subprocess.Popen(command, stdout=sys.stderr, pass_fds=(write,),
                                            preexec_fn=_die_with_parent))  # fmt: skip
            os.close(write)
            beats.append(read)
        log.info("ranks_started", size=size, attention=config.attention, pids=[w.pid for w in workers])
        group = cls(0, size, workdir, _backend(config), workers)
        threading.Thread(target=group._watch, args=(beats,), name="rank-watchdog", daemon=True).start()
        try:
            group.join()
        except BaseException:
            group.kill()
            raise
        return group

    def join(self) -> None:
        dist.init_process_group(self.backend, init_method=f"file://{os.path.join(self.workdir, 'store')}",
                                rank=self.rank, world_size=self.size, timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
        self.control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)

    def send(self, message: Any) -> None:
        """Rank 0: the next message for every other rank (None: stop)."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> Any:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's value, in rank order, on every rank."""
        values = [None] * self.size
        dist.all_gather_object(values, value, group=self.control)
        return values

    def close(self) -> None:
        """Rank 0, serving: tell the other ranks to stop, wait for them (killing any left), leave the group."""
        if self.closing:
            return
        self.closing = True
        try:
            self.send(None)
        except Exception as error:  # a rank already gone: it is killed below
            log.warning("ranks_stop_failed", error=repr(error))
        deadline = time.monotonic() + STOP_WAIT_S
        for worker in self.workers:
            try:
                worker.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        dist.destroy_process_group()
        shutil.rmtree(self.workdir, ignore_errors=True)
        log.info("ranks_stopped", exit_codes=[w.returncode for w in self.workers])

    def kill(self) -> None:
        """Rank 0, failing to start: the other ranks are killed where they are."""
        self.closing = True
        for worker in self.workers:
            worker.kill()
            worker.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _watch(self, beats: list[int]) -> None:
        """Rank 0's watchdog: a rank that exits (its pipe closes) or whose heartbeat stops ends the engine, unless
        rank 0 is stopping them."""
        seen = {fd: time.monotonic() for fd in beats}
        rank_of = {fd: rank for rank, fd in enumerate(beats, start=1)}
        while seen:
            ready, _, _ = select.select(list(seen), [], [], HEARTBEAT_S)
            now = time.monotonic()
            for fd in ready:
                if os.read(fd, 4096):
                    seen[fd] = now
                    continue
                del seen[fd]
                os.close(fd)
                worker = self.workers[rank_of[fd] - 1]
                try:
                    code = worker.wait(STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    code = None
                if not self.closing:
                    self._end_engine("rank_exited", rank=rank_of[fd], pid=worker.pid, exit_code=code)
            for fd, last in seen.items():
                if now - last > HUNG_S and not self.closing:
                    self._end_engine("rank_unresponsive", rank=rank_of[fd], pid=self.workers[rank_of[fd] - 1].pid,
                                     silent_s=round(now - last, 1))  # fmt: skip

    def _end_engine(self, event: str, **facts) -> None:
        log.error(event, **facts, action="ending the engine: every rank is stopped")
        for worker in self.workers:
            if worker.poll() is None:
                worker.kill()
        for worker in self.workers:
            worker.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
        sys.stderr.flush()
        os._exit(1)


def _heartbeat(fd: int) -> None:
    while True:
        os.write(fd, b".")
        time.sleep(HEARTBEAT_S)


def worker_main(argv: list[str] | None = None) -> None:
    """Rank 1 .. N-1: boot this rank's part of the model, then run the plans rank 0 sends until it says stop."""
    parser = argparse.ArgumentParser(prog="python -m engine rank")
    for flag in ("--rank", "--size", "--heartbeat-fd"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    from engine.logging import configure_logging

    configure_logging()
    structlog.contextvars.bind_contextvars(rank=args.rank)
    threading.Thread(target=_heartbeat, args=(args.heartbeat_fd,), daemon=True).start()
    with open(os.path.join(args.dir, "config.json")) as f:
        config = EngineConfig(**json.load(f))
    try:
        from engine.boot import boot
        from engine.llm_engine import context_length_of
        from engine.model_runner import ModelRunner

        ranks = RankGroup(args.rank, args.size, args.dir, _backend(config))
        ranks.join()
        booted = boot(config, context_length_of(config), ranks)
        runner = ModelRunner(booted, ranks)
        ranks.gather(booted.memory)  # ready: rank 0 reports every rank's memory
        runner.serve()
    except Exception as error:
        log.exception("rank_failed", error=repr(error))
        sys.stderr.flush()
        os._exit(1)
    log.info("rank_stopped")
    sys.stderr.flush()
    # Not through the interpreter's teardown: gloo's destructors may abort once rank 0 has closed its side.
    os._exit(0)
