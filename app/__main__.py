"""`python -m app`: start the console."""

from __future__ import annotations

import uvicorn

from app.logging import configure_logging
from app.main import create_app
from app.settings import load_settings


def main() -> None:
    settings = load_settings()
    configure_logging(json=settings.log_json)
    # No uvicorn access log: the console logs each request itself, with its request id (app/logging.py).
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None, access_log=False)


if __name__ == "__main__":
    main()
