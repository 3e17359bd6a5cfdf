"""`python -m engine serve --model DIR …`: the engine as a process (see engine/server/cli.py). `python -m engine
rank …` is how that process starts its other ranks over several GPUs (engine/parallel.py)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["rank"]:
        from engine.parallel import worker_main

        worker_main(sys.argv[2:])
    from engine.server.cli import main

    sys.exit(main())
