"""`python -m engine.tools.ship_demo --from DIR`: puts a training run's checkpoint (`python -m engine.tools.train_demo
--out DIR`) into engine/demo_model/, the demo model the project ships and the console installs for `cpu-demo`, with
its SHA256SUMS (sha256sum's format: the console checks every file against it before installing).

Only the files the engine serves from are shipped (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), never the run's logs or answers; a model.safetensors over train_demo.MAX_CHECKPOINT_BYTES is
refused, and so is a run missing any of them, before anything in engine/demo_model/ changes. README.md there is
written by hand and kept.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import structlog

from engine.logging import configure_logging
from engine.tools.train_demo import MAX_CHECKPOINT_BYTES

log = structlog.get_logger(__name__)

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "demo_model"
SHIPPED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
SUMS = "SHA256SUMS"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_run(run: Path) -> None:
    """Raises ValueError naming what makes `run` unfit to ship."""
    missing = [name for name in SHIPPED_FILES if not (run / name).is_file()]
    if missing:
        raise ValueError(f"{run} is not a trained checkpoint: it lacks {', '.join(missing)}")
    size = (run / "model.safetensors").stat().st_size
    if size > MAX_CHECKPOINT_BYTES:
        raise ValueError(
            f"{run / 'model.safetensors'} is {size:,} bytes, over the {MAX_CHECKPOINT_BYTES:,} the project ships"
        )
    model_type = json.loads((run / "config.json").read_text()).get("model_type")
    if model_type != "deepseek_v4":
        raise ValueError(f"{run / 'config.json'}: model_type is {model_type!r}, not 'deepseek_v4'")


def ship(run: Path, dest: Path = DEMO_MODEL_DIR) -> dict[str, str]:
    """Copies the run's checkpoint into `dest` and writes SHA256SUMS there; returns each file's digest. Each file is
    written beside its place and renamed into it; SHA256SUMS last, from the copies."""
    check_run(run)
    dest.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name in SHIPPED_FILES:
        partial = dest / f".{name}.partial"
        shutil.copyfile(run / name, partial)
        partial.chmod(0o644)
        partial.replace(dest / name)
        digests[name] = sha256(dest / name)
    partial = dest / f".{SUMS}.partial"
    partial.write_text("".join(f"{digest}  {name}\n" for name, digest in digests.items()))
    partial.replace(dest / SUMS)
    log.info("demo_model_shipped", run=str(run), dest=str(dest), bytes=(dest / "model.safetensors").stat().st_size)
    return digests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="run", type=Path, required=True, help="a train_demo run's --out directory")
    parser.add_argument("--to", type=Path, default=DEMO_MODEL_DIR, help="where the shipped model goes")
    args = parser.parse_args()
    configure_logging()
    try:
        ship(args.run, args.to)
    except ValueError as exc:
        parser.exit(2, f"ship_demo: {exc}\n")
    print(f"demo model shipped to {args.to}; commit it with its SHA256SUMS")


if __name__ == "__main__":
    main()
