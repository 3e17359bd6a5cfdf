"""Prints the image's Python requirements, one a line: pyproject.toml's dependencies and its `server` and `console`
extras (what `pip install '.[server,console]'` asks for). The Dockerfile installs them; `make wheelhouse` downloads
them, so the two never disagree."""

import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
extras = project["optional-dependencies"]
print("\n".join(dict.fromkeys(project["dependencies"] + extras["server"] + extras["console"])))
