"""Profile lifecycle: seed, create, make a child, change in place while there is no evidence, retire.

Every write validates first and then commits the row and its audit record in one transaction, so an invalid
request leaves nothing behind.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog
import yaml
from litestar.exceptions import NotFoundException
from msgspec import UnsetType
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from app.audit import service as audit
from app.db import utcnow
from app.errors import Conflict, FieldError, InvalidFields, name_errors
from app.profiles.engine_options import extras_errors
from app.profiles.models import Profile
from app.profiles.schemas import (
    DEFAULT_MODEL_MAX_CONTEXT,
    SETTINGS,
    HostGpus,
    ProfileChildCreate,
    ProfileCreate,
    ProfileRead,
    ProfileSettings,
    ProfileState,
    ProfileUpdate,
    content_hash,
    diff_warnings,
    host_errors,
    settings_diff,
    settings_errors,
)

log = structlog.get_logger(__name__)

# The roles the route starts a profile in: production (restarts, resumes) and rollback (the last known good).
ROUTE_ROLES = ("production", "rollback")

# How a host rule broken by a seeded profile reads as its state.
BLOCKER_LABELS = {
    "tensor_parallel_size": "more GPUs than this host has",
    "gpus": "GPUs not on this host",
    "context_length": "context longer than the model allows",
}
GPU_RULES = ("tensor_parallel_size", "gpus")


class NameTaken(Conflict):
    """Another profile has the name: a form shows it at its name field."""

    field = "name"


@dataclass(frozen=True)
class ModelFiles:
    weights_present: bool
    max_context: int


def inspect_model(models_dir: Path, model: str) -> ModelFiles:
    """What the model directory says: whether weights are there, and the longest context its config allows."""
    directory = models_dir / model
    config = directory / "config.json"
    max_context = DEFAULT_MODEL_MAX_CONTEXT
    try:
        value = json.loads(config.read_text()).get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            max_context = value
    except (OSError, ValueError, AttributeError):
        pass
    return ModelFiles(
        weights_present=config.is_file() and any(directory.glob("*.safetensors")), max_context=max_context
    )


def settings_of(profile: Profile) -> ProfileSettings:
    return ProfileSettings(**{f: getattr(profile, f) for f in SETTINGS})


def snapshot(profile: Profile, parent: Profile | None = None) -> dict[str, Any]:
    """A profile as the audit trail stores it."""
    return {
        "name": profile.name,
        "parent": parent.name if parent else None,
        "rationale": profile.rationale,
        **msgspec.structs.asdict(settings_of(profile)),
        "content_hash": profile.content_hash,
        "retired": profile.retired,
    }


def profile_named(session: Session, name: str) -> Profile:
    """The profile of that name; 404 naming it when there is none."""
    profile = session.exec(select(Profile).where(Profile.name == name)).first()
    if profile is None:
        raise NotFoundException(f"no profile named {name!r}")
    return profile


@dataclass(frozen=True)
class ProfileFacts:
    """What the domains above profiles know about them, passed in from app/main.py (profiles import none of them):
    the roles each profile holds (production and rollback from the route, rejected from decisions, challenger from
    runs), its evidence count (any evidence makes it immutable), and what its page shows besides its settings (its
    recent runs, what a run would stop), and the GPUs this host shows (telemetry's NVML, which the GPU rules check
    against)."""

    roles: Callable[[Session], dict[int, list[str]]]
    evidence_count: Callable[[Session, int], int]
    page: Callable[[Session, Profile], dict[str, Any]]
    host_gpus: Callable[[], HostGpus] = HostGpus


class ProfileService:
    def __init__(self, session: Session, models_dir: Path, facts: ProfileFacts) -> None:
        self.session = session
        self.models_dir = models_dir
        self.facts = facts

    @functools.cached_property
    def host_gpus(self) -> HostGpus:
        """Read once per service (a request): the GPU rules of every profile it reads check the same answer."""
        return self.facts.host_gpus()

    # Reading

    def get(self, name: str) -> Profile:
        return profile_named(self.session, name)

    def read_all(self) -> list[ProfileRead]:
        profiles = self.session.exec(select(Profile).order_by(col(Profile.retired), Profile.name)).all()
        by_id = {p.id: p for p in profiles}
        roles = self.facts.roles(self.session)
        return [
            self.read(
                p, by_id.get(p.parent_id), sorted(c.name for c in profiles if c.parent_id == p.id), roles.get(p.id, [])
            )
            for p in profiles
        ]

    def read_one(self, name: str) -> ProfileRead:
        profile = self.get(name)
        parent = self.session.get(Profile, profile.parent_id) if profile.parent_id else None
        children = self.session.exec(select(Profile.name).where(Profile.parent_id == profile.id)).all()
        return self.read(profile, parent, sorted(children), self.facts.roles(self.session).get(profile.id, []))

    def read(self, profile: Profile, parent: Profile | None, children: list[str], roles: list[str]) -> ProfileRead:
        settings = settings_of(profile)
        files = inspect_model(self.models_dir, profile.model)
        evidence = self.facts.evidence_count(self.session, profile.id)
        broken = host_errors(settings, files.max_context, self.host_gpus)
        blockers = [] if files.weights_present else ["weights missing"]
        blockers += [BLOCKER_LABELS[e.field] for e in broken]
        diff = settings_diff(settings_of(parent), settings) if parent else []
        return ProfileRead(
            **msgspec.structs.asdict(settings),
            name=profile.name,
            parent=parent.name if parent else None,
            children=children,
            rationale=profile.rationale,
            content_hash=profile.content_hash,
            created_at=profile.created_at,
            created_by=profile.created_by,
            retired_at=profile.retired_at,
            retired_by=profile.retired_by,
            state=ProfileState(
                weights_present=files.weights_present,
                model_max_context=files.max_context,
                tensor_parallel_available=not any(e.field in GPU_RULES for e in broken),
                evidence_count=evidence,
                immutable=evidence > 0,
                retired=profile.retired,
                blockers=blockers,
            ),
            diff=diff,
            warnings=diff_warnings(diff),
            roles=roles,
        )

    # Writing

    def _write_errors(self, settings: ProfileSettings) -> list[FieldError]:
        return settings_errors(settings) + host_errors(
            settings, inspect_model(self.models_dir, settings.model).max_context, self.host_gpus
        )

    @staticmethod
    def _extras_errors(extras: dict[str, Any] | UnsetType) -> list[FieldError]:
        """The extras a write sets (a child keeps its parent's, checked when the parent was written), checked before
        the write reads anything: the engine's first answer takes seconds, and a SQLite snapshot held across them
        could not be written once another write committed meanwhile."""
        return extras_errors(extras, SETTINGS) if isinstance(extras, dict) else []

    @staticmethod
    def _taken_message(name: str) -> str:
        return f"a profile named {name!r} already exists: choose another name"

    def _taken_errors(self, name: str) -> list[FieldError]:
        """A taken name among a write's other errors, so one answer names them all; alone it is a 409 (NameTaken)."""
        taken = self.session.exec(select(Profile.id).where(Profile.name == name)).first() is not None
        return [FieldError("name", self._taken_message(name))] if taken else []

    def _insert(self, actor: str, action: str, profile: Profile, parent: Profile | None, **extra: Any) -> Profile:
        """Add a validated profile and its audit row; a taken name surfaces here (the unique index decides, so two
        requests racing for one name cannot both win) and rolls everything back."""
        self.session.add(profile)
        try:
            self.session.flush()
        except IntegrityError as exc:
            self.session.rollback()
            raise NameTaken(self._taken_message(profile.name)) from exc
        audit.record(
            self.session, actor, action, f"profile:{profile.name}", after={**snapshot(profile, parent), **extra}
        )
        return profile

    def _new(self, name: str, rationale: str, settings: ProfileSettings, actor: str, parent: Profile | None) -> Profile:
        return Profile(
            name=name,
            parent_id=parent.id if parent else None,
            rationale=rationale.strip(),
            **msgspec.structs.asdict(settings),
            content_hash=content_hash(settings),
            created_by=actor,
        )

    def create(self, actor: str, data: ProfileCreate) -> Profile:
        extras = self._extras_errors(data.engine_extras)
        settings = ProfileSettings(**{f: getattr(data, f) for f in SETTINGS})
        if errors := name_errors(data.name) + extras + self._write_errors(settings):
            raise InvalidFields(errors + self._taken_errors(data.name))
        profile = self._insert(
            actor, "profile.create", self._new(data.name, data.rationale, settings, actor, None), None
        )
        self.session.commit()
        return profile

    def create_child(
        self, actor: str, parent_name: str, data: ProfileChildCreate, unreadable: list[FieldError] | None = None
    ) -> Profile:
        """A copy of the parent with the requested changes; evidence never carries over. `unreadable`: the form's
        fields that were not a value of their type (the request keeps the parent's value for each), refused together
        with every rule the rest breaks."""
        unreadable = unreadable or []
        extras = self._extras_errors(data.engine_extras)
        parent = self.get(parent_name)
        base = settings_of(parent)
        settings = msgspec.structs.replace(base, **data.as_dict())
        errors = name_errors(data.name) + unreadable + extras
        if not data.rationale.strip():
            errors.append(
                FieldError("rationale", "rationale is required for a child: say which setting changed and why")
            )
        if not settings_diff(base, settings) and not unreadable:
            errors.append(
                FieldError("settings", f"a child must change at least one setting from its parent {parent_name!r}")
            )
        if errors := errors + self._write_errors(settings):
            raise InvalidFields(errors + self._taken_errors(data.name))
        child = self._insert(
            actor, "profile.create_child", self._new(data.name, data.rationale, settings, actor, parent), parent
        )
        self.session.commit()
        return child

    def update(self, actor: str, name: str, data: ProfileUpdate) -> Profile:
        """Change a profile in place; refused once it has evidence (then editing means making a child)."""
        extras = self._extras_errors(data.engine_extras)
        profile = self.get(name)
        if profile.retired:
            raise Conflict(f"profile {name!r} is retired and cannot change; make a child of it instead")
        if count := self.facts.evidence_count(self.session, profile.id):
            raise Conflict(
                f"profile {name!r} is immutable: it has {count} evidence row(s); make a child of it to change a setting"
            )
        settings = msgspec.structs.replace(settings_of(profile), **data.as_dict())
        if errors := extras + self._write_errors(settings):
            raise InvalidFields(errors)
        parent = self.session.get(Profile, profile.parent_id) if profile.parent_id else None
        before = snapshot(profile, parent)
        for field, value in msgspec.structs.asdict(settings).items():
            setattr(profile, field, value)
        if isinstance(data.rationale, str):
            profile.rationale = data.rationale.strip()
        profile.content_hash = content_hash(settings)
        audit.record(
            self.session, actor, "profile.update", f"profile:{name}", before=before, after=snapshot(profile, parent)
        )
        self.session.commit()
        return profile

    def retire(self, actor: str, name: str) -> Profile:
        """Take a profile out of use; it and its evidence stay on record. Refused while it holds the production or
        rollback role: the route must be able to start it."""
        profile = self.get(name)
        if profile.retired:
            raise Conflict(f"profile {name!r} is already retired")
        held = [r for r in self.facts.roles(self.session).get(profile.id, []) if r in ROUTE_ROLES]
        if held:
            raise Conflict(
                f"profile {name!r} holds the {' and '.join(held)} role: retired, it could neither restart nor resume "
                f"nor be rolled back to; promote another profile first"
            )
        profile.retired, profile.retired_at, profile.retired_by = True, utcnow(), actor
        audit.record(
            self.session, actor, "profile.retire", f"profile:{name}", before={"retired": False}, after={"retired": True}
        )
        self.session.commit()
        return profile

    def seed(self, directory: Path) -> list[str]:
        """Insert each `*.yaml` profile whose name is not in the database yet; never touch one that is, so an
        operator's changes survive restarts and upgrades. A seed breaking a host rule is kept and shows it as state."""
        existing = set(self.session.exec(select(Profile.name)).all())
        created = []
        for path in sorted(directory.glob("*.yaml")):
            try:
                data = msgspec.convert(yaml.safe_load(path.read_text()), ProfileCreate)
            except msgspec.ValidationError as exc:
                raise ValueError(f"seed profile {path}: {exc}") from exc
            settings = ProfileSettings(**{f: getattr(data, f) for f in SETTINGS})
            errors = name_errors(data.name) + settings_errors(settings) + extras_errors(data.engine_extras, SETTINGS)
            if data.name != path.stem:
                errors.append(FieldError("name", f"name must match the file name {path.stem!r}, got {data.name!r}"))
            if errors:
                raise ValueError(f"seed profile {path}: " + "; ".join(e.message for e in errors))
            if data.name in existing:
                continue
            profile = self._new(data.name, data.rationale, settings, "seed", None)
            self._insert("system", "profile.seed", profile, None, source=f"profiles/{path.name}")
            created.append(data.name)
        self.session.commit()
        if created:
            log.info("profiles_seeded", profiles=created)
        return created
