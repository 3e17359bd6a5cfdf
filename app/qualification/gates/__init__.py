"""The gate ladder (reference/qualification.md §2): versioned definitions with their exact inputs, pass rules and
measurements, run in order against any OpenAI-compatible endpoint.

A gate's version changes whenever its inputs or its rule change, so results stay comparable only where they
should. Structural gates ask whether the engine serves, survives and how fast; capability gates ask whether the
model answers an agent correctly (a model that cannot, such as a random checkpoint or a demo model short of them,
fails those, honestly, with the evidence).

One module per kind of gate; this one puts them in the ladder's order."""

from __future__ import annotations

from app.qualification.gates.answers import JsonAnswer, PostStressSmoke, Smoke
from app.qualification.gates.base import Gate
from app.qualification.gates.context import ClientShapes, Needle
from app.qualification.gates.host import LogScan, VramReserve
from app.qualification.gates.performance import Performance
from app.qualification.gates.readiness import Readiness
from app.qualification.gates.responses import Responses
from app.qualification.gates.tools import StreamingTools, ToolBurst, ToolResult

LADDER: tuple[Gate, ...] = (
    Readiness(),
    Smoke(),
    JsonAnswer(),
    ToolBurst(),
    StreamingTools(),
    ToolResult(),
    Responses(),
    Needle(),
    PostStressSmoke(),
    ClientShapes(),
    Performance(),
    VramReserve(),
    LogScan(),
)

GATES = {gate.name: gate for gate in LADDER}
