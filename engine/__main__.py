"""`python -m engine serve --model DIR …`: the engine as a process (see engine/server/cli.py)."""

import sys

from engine.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
