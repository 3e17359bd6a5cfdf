"""The roles a profile holds, shown wherever profiles are: `production` and `rollback` (the route's), `rejected` (the
latest decision on it), `challenger` (qualified or being qualified, and none of the others)."""

from __future__ import annotations

from sqlmodel import Session, col, select

from app.profiles.roles import route_row
from app.qualification.models import Decision, DecisionKind, QualificationRun

ROLES = ("production", "rollback", "challenger", "rejected")


def roles_by_profile(session: Session) -> dict[int, list[str]]:
    roles: dict[int, list[str]] = {}
    route = route_row(session)
    if route is not None:
        for profile_id, role in ((route.production_id, "production"), (route.rollback_id, "rollback")):
            if profile_id is not None:
                roles.setdefault(profile_id, []).append(role)
    latest: dict[int, DecisionKind] = {}
    for profile_id, decision in session.exec(select(Decision.profile_id, Decision.decision).order_by(col(Decision.id))):
        latest[profile_id] = decision
    for profile_id, decision in latest.items():
        if decision is DecisionKind.reject:
            roles.setdefault(profile_id, []).append("rejected")
    for profile_id in session.exec(select(QualificationRun.profile_id).distinct()):
        roles.setdefault(profile_id, ["challenger"])
    return roles
