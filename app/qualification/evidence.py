"""Queries over evidence that other domains rely on (kept free of heavier imports: profiles import it)."""

from __future__ import annotations

from sqlalchemy import func
from sqlmodel import Session, select

from app.qualification.models import Evidence


def evidence_count(session: Session, profile_id: int) -> int:
    """How many evidence rows a profile has; any at all makes the profile immutable."""
    return session.exec(select(func.count()).select_from(Evidence).where(Evidence.profile_id == profile_id)).one()
