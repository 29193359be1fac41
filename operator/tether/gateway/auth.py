"""Bearer tokens checked with TokenReview (audience included), access with SubjectAccessReview.

Tokens are never logged; cache keys are their SHA-256.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, Hashable, TypeVar

from tether.kube.client import KubeClient
from tether.kube.paths import SUBJECT_ACCESS_REVIEWS, TOKEN_REVIEWS

CACHE_SECONDS = 10.0
# Entries each cache holds at most: anyone may present tokens, so their number must not grow memory.
CACHE_ENTRIES = 4096

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    """Answers kept for CACHE_SECONDS, the least recently stored dropped beyond CACHE_ENTRIES."""

    def __init__(self) -> None:
        self._items: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def get(self, key: K) -> V | None:
        hit = self._items.get(key)
        return hit[1] if hit is not None and hit[0] > time.monotonic() else None

    def put(self, key: K, value: V) -> None:
        self._items[key] = (time.monotonic() + CACHE_SECONDS, value)
        self._items.move_to_end(key)
        while len(self._items) > CACHE_ENTRIES:
            self._items.popitem(last=False)


@dataclass(frozen=True)
class Caller:
    username: str
    uid: str
    groups: tuple[str, ...]
    extra: dict[str, Any]


class AuthError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class Authenticator:
    def __init__(self, kube: KubeClient, audience: str | None) -> None:
        self.kube = kube
        self.audience = audience
        # A rejected token is remembered too (as None's stand-in, the message): bogus tokens cost one
        # TokenReview per CACHE_SECONDS, not one per request.
        self._tokens: TtlCache[str, Caller | str] = TtlCache()
        self._access: TtlCache[tuple[str, str, str, str], bool] = TtlCache()

    async def authenticate(self, header: str | None) -> Caller:
        if not header or not header.lower().startswith("bearer "):
            raise AuthError(401, "Unauthorized", "a bearer token is required")
        token = header[7:].strip()
        key = hashlib.sha256(token.encode()).hexdigest()
        cached = self._tokens.get(key)
        if isinstance(cached, Caller):
            return cached
        if cached is not None:
            raise AuthError(401, "Unauthorized", cached)
        spec: dict[str, Any] = {"token": token}
        if self.audience:
            spec["audiences"] = [self.audience]
        review = await self.kube.create(TOKEN_REVIEWS,
                                        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec})
        status = review.get("status") or {}
        refusal = None
        if not status.get("authenticated"):
            refusal = "the token is not valid" + (f" for audience {self.audience}" if self.audience else "")
        elif self.audience and self.audience not in (status.get("audiences") or []):
            refusal = f"the token is not meant for audience {self.audience}"
        if refusal is not None:
            self._tokens.put(key, refusal)
            raise AuthError(401, "Unauthorized", refusal)
        user = status.get("user") or {}
        caller = Caller(username=user.get("username", ""), uid=user.get("uid", ""),
                        groups=tuple(user.get("groups") or []), extra=user.get("extra") or {})
        self._tokens.put(key, caller)
        return caller

    async def authorize(self, caller: Caller, namespace: str, name: str, verb: str = "claim") -> None:
        key = (caller.username, namespace, name, verb)
        cached = self._access.get(key)
        if cached is not None:
            allowed = cached
        else:
            review = await self.kube.create(SUBJECT_ACCESS_REVIEWS, {
                "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                "spec": {"user": caller.username, "uid": caller.uid, "groups": list(caller.groups),
                         "extra": caller.extra,
                         "resourceAttributes": {"namespace": namespace, "verb": verb, "group": "tether.dev",
                                                "resource": "workerruns", "name": name}}})
            allowed = bool((review.get("status") or {}).get("allowed"))
            self._access.put(key, allowed)
        if not allowed:
            raise AuthError(403, "Forbidden", f"{caller.username} may not {verb} workerruns/{name} in {namespace}")
