"""Engine log files: one per start under FLASHGATE_DATA_DIR/engine-logs, the latest N kept."""

from __future__ import annotations

import os
from pathlib import Path

RUN_LOG_GLOB = "run-*.log"
_BLOCK = 64 * 1024


def run_log_path(logs_dir: Path, run_id: int) -> Path:
    # Zero-padded, so the names sort in start order.
    return logs_dir / f"run-{run_id:06d}.log"


def tail_lines(path: Path, count: int) -> list[str]:
    """The last `count` lines, read from the end (a long run's log can be large)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            end = position = f.tell()
            data = b""
            while position > 0 and data.count(b"\n") <= count:
                step = min(_BLOCK, position)
                position -= step
                f.seek(position)
                data = f.read(step) + data
    except OSError:
        return []
    lines = data.decode(errors="replace").splitlines()
    return lines[-count:] if end else []


def prune(logs_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` run logs; returns what was deleted."""
    logs = sorted(logs_dir.glob(RUN_LOG_GLOB))
    removed = logs[: max(0, len(logs) - keep)]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed
