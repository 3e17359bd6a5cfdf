"""The route's roles, which every domain above profiles reads: the profile that holds production and the last known
good (rollback). Only the switch (app/promotion) writes them."""

from __future__ import annotations

from sqlmodel import Session

from app.profiles.models import PRODUCTION, Route


def route_row(session: Session) -> Route | None:
    return session.get(Route, PRODUCTION)


def production_id(session: Session) -> int | None:
    route = route_row(session)
    return route.production_id if route else None
