"""What a recorded benchmark result was measured with: commit, date, torch and triton versions.

The commit is `FLASHGATE_COMMIT` when set (as in the image, or a copy of the tree whose .git lags behind what it
holds), otherwise `git describe --always --dirty` of this checkout.
"""

from __future__ import annotations

import datetime
import os
import subprocess

import torch
import triton


def provenance() -> dict[str, str]:
    commit = (
        os.environ.get("FLASHGATE_COMMIT")
        or subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    )
    return {
        "commit": commit or "unknown",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
