"""The shipped demo model (engine/demo_model/) and the tool that ships it: every shipped file matches SHA256SUMS, as
sha256sum itself checks it; the checkpoint fits the size the project ships; `ship_demo` writes what it checks and
refuses a run it cannot ship before anything changes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.tools.ship_demo import DEMO_MODEL_DIR, SHIPPED_FILES, SUMS, sha256, ship
from engine.tools.train_demo import MAX_CHECKPOINT_BYTES

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_files_match_their_sha256sums_and_fit_the_size_shipped():
    lines = (DEMO_MODEL_DIR / SUMS).read_text().splitlines()
    assert sorted(line.split("  ", 1)[1] for line in lines) == sorted(SHIPPED_FILES)
    checked = subprocess.run(["sha256sum", "--check", "--strict", SUMS], cwd=DEMO_MODEL_DIR, capture_output=True)
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()
    assert (DEMO_MODEL_DIR / "model.safetensors").stat().st_size <= MAX_CHECKPOINT_BYTES
    assert (DEMO_MODEL_DIR / "README.md").is_file()


def _run(tmp_path: Path) -> Path:
    """A training run's output: the shipped files plus what a run also writes and is not shipped."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    for name in SHIPPED_FILES:
        shutil.copyfile(DEMO_MODEL_DIR / name, run / name)
    (run / "train_log.json").write_text("{}\n")
    return run


def test_ship_copies_the_checkpoint_and_writes_sha256sums_that_sha256sum_accepts(tmp_path):
    dest = tmp_path / "demo_model"
    dest.mkdir()
    (dest / "README.md").write_text("kept\n")
    done = subprocess.run(
        [sys.executable, "-m", "engine.tools.ship_demo", "--from", str(_run(tmp_path)), "--to", str(dest)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in dest.iterdir()) == sorted([*SHIPPED_FILES, SUMS, "README.md"])
    assert (dest / "README.md").read_text() == "kept\n"
    assert subprocess.run(["sha256sum", "--check", "--strict", SUMS], cwd=dest, capture_output=True).returncode == 0
    assert (dest / SUMS).read_text() == (DEMO_MODEL_DIR / SUMS).read_text()


def test_ship_refuses_an_oversized_checkpoint_and_changes_nothing(tmp_path):
    run = _run(tmp_path)
    with (run / "model.safetensors").open("r+b") as f:
        f.truncate(MAX_CHECKPOINT_BYTES + 1)
    dest = tmp_path / "demo_model"
    ship(_run(tmp_path / "earlier"), dest)
    before = {p.name: sha256(p) for p in dest.iterdir()}
    with pytest.raises(ValueError, match=f"is {MAX_CHECKPOINT_BYTES + 1:,} bytes, over the {MAX_CHECKPOINT_BYTES:,}"):
        ship(run, dest)
    assert {p.name: sha256(p) for p in dest.iterdir()} == before

    done = subprocess.run(
        [sys.executable, "-m", "engine.tools.ship_demo", "--from", str(run), "--to", str(dest)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "over the 20,000,000 the project ships" in done.stderr


def test_ship_refuses_a_run_without_its_tokenizer(tmp_path):
    run = _run(tmp_path)
    os.remove(run / "tokenizer.json")
    with pytest.raises(ValueError, match="is not a trained checkpoint: it lacks tokenizer.json"):
        ship(run, tmp_path / "demo_model")
    assert not (tmp_path / "demo_model").exists()
