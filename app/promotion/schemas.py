from __future__ import annotations

import msgspec


class PromotionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    profile: str
    reason: str = ""
