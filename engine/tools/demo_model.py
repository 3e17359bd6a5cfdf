"""`python -m engine.tools.demo_model --out DIR`: puts the demo model shipped with the project (engine/demo_model/:
a DeepSeek-V4 of 8M parameters trained by engine/tools/train_demo.py, issue 31) at DIR, each file checked against
the SHA256SUMS shipped beside it, before and after the copy: a damaged checkpoint is refused, never served.
`--check` checks the shipped files only."""

from __future__ import annotations

import argparse
import hashlib
import shutil
from pathlib import Path

from engine.logging import configure_logging

SHIPPED = Path(__file__).resolve().parents[1] / "demo_model"
SUMS = "SHA256SUMS"


class DamagedCheckpoint(ValueError):
    """A file of the checkpoint is missing or does not match its checksum."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checksums(directory: Path = SHIPPED) -> dict[str, str]:
    """SHA256SUMS as {file name: hex digest} (`sha256sum`'s format: digest, two spaces, name)."""
    lines = (directory / SUMS).read_text().splitlines()
    return {name: digest for digest, name in (line.split(maxsplit=1) for line in lines if line.strip())}


def verify(directory: Path, expected: dict[str, str]) -> None:
    """Raise DamagedCheckpoint naming every file of `expected` that `directory` lacks or holds changed."""
    problems = []
    for name, digest in expected.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif (actual := sha256(path)) != digest:
            problems.append(f"{name} has sha256 {actual}, expected {digest}")
    if problems:
        raise DamagedCheckpoint(f"the demo model in {directory} is damaged: " + "; ".join(problems))


def install(out: Path, source: Path = SHIPPED) -> Path:
    """Copy the checked checkpoint to `out` (a new directory) and check the copy."""
    expected = checksums(source)
    verify(source, expected)
    out.mkdir(parents=True)
    for name in [*expected, SUMS]:
        shutil.copyfile(source / name, out / name)
    verify(out, expected)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="a new directory to put the checkpoint in")
    group.add_argument("--check", action="store_true", help="only check the shipped files against SHA256SUMS")
    args = parser.parse_args()
    configure_logging()
    if args.check:
        verify(SHIPPED, checksums(SHIPPED))
        print(f"the demo model in {SHIPPED} matches {SUMS}")
        return
    install(args.out)
    print(f"demo model written to {args.out}")


if __name__ == "__main__":
    main()
