"""`/api/profiles`: list, view (state and diff against the parent), create, make a child, change, retire."""

from __future__ import annotations

from litestar import Controller, Request, get, patch, post
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, JSONBody
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED
from sqlmodel import Session

from app.auth.guards import requires_operator, requires_viewer
from app.errors import Conflict, InvalidFields
from app.profiles.schemas import ProfileChildCreate, ProfileCreate, ProfileRead, ProfileUpdate
from app.profiles.service import ProfileService


def provide_profile_service(db_session: NamedDependency[Session], state: State) -> ProfileService:
    return ProfileService(db_session, state.settings.models_dir, state.profile_facts)


class ProfileController(Controller):
    path = "/api/profiles"
    tags = ["profiles"]
    guards = [requires_viewer]
    dependencies = {"profiles": Provide(provide_profile_service, sync_to_thread=False)}

    @get("/", operation_id="listProfiles", sync_to_thread=True)
    def list_profiles(self, profiles: NamedDependency[ProfileService]) -> list[ProfileRead]:
        """Every profile, retired ones last, each with its state and its diff against its parent."""
        return profiles.read_all()

    @post(
        "/",
        guards=[requires_operator],
        operation_id="createProfile",
        raises=[InvalidFields, Conflict],
        status_code=HTTP_201_CREATED,
        sync_to_thread=True,
    )
    def create_profile(
        self, request: Request, profiles: NamedDependency[ProfileService], data: JSONBody[ProfileCreate]
    ) -> ProfileRead:
        """Create a root profile (one without a parent)."""
        return profiles.read_one(profiles.create(request.user.name, data).name)

    @get("/{name:str}", operation_id="getProfile", sync_to_thread=True)
    def get_profile(self, profiles: NamedDependency[ProfileService], name: FromPath[str]) -> ProfileRead:
        """One profile: settings, state (weights, the GPUs it needs, evidence, retired) and diff against its parent."""
        return profiles.read_one(name)

    @patch(
        "/{name:str}",
        guards=[requires_operator],
        operation_id="updateProfile",
        raises=[InvalidFields, Conflict],
        sync_to_thread=True,
    )
    def update_profile(
        self,
        request: Request,
        profiles: NamedDependency[ProfileService],
        name: FromPath[str],
        data: JSONBody[ProfileUpdate],
    ) -> ProfileRead:
        """Change settings in place; 409 once the profile has evidence (make a child instead)."""
        return profiles.read_one(profiles.update(request.user.name, name, data).name)

    @post(
        "/{name:str}/children",
        guards=[requires_operator],
        operation_id="createChildProfile",
        raises=[InvalidFields, Conflict],
        status_code=HTTP_201_CREATED,
        sync_to_thread=True,
    )
    def create_child(
        self,
        request: Request,
        profiles: NamedDependency[ProfileService],
        name: FromPath[str],
        data: JSONBody[ProfileChildCreate],
    ) -> ProfileRead:
        """Make a child of a profile: its settings plus the given changes. `warnings` says when more than one
        setting differs from the parent."""
        return profiles.read_one(profiles.create_child(request.user.name, name, data).name)

    @post(
        "/{name:str}/retire",
        guards=[requires_operator],
        operation_id="retireProfile",
        raises=[Conflict],
        status_code=HTTP_200_OK,
        sync_to_thread=True,
    )
    def retire_profile(
        self, request: Request, profiles: NamedDependency[ProfileService], name: FromPath[str]
    ) -> ProfileRead:
        """Retire a profile: it stays on record with its evidence but is no longer offered. 409 naming the role while
        it holds the production or rollback role (the route must be able to start it)."""
        return profiles.read_one(profiles.retire(request.user.name, name).name)
