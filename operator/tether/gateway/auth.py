"""Bearer tokens checked with TokenReview (audience included), access with SubjectAccessReview.

Tokens are never logged; cache keys are their SHA-256.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from tether.kube.client import KubeClient

CACHE_SECONDS = 10.0


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
        self._tokens: dict[str, tuple[float, Caller]] = {}
        self._access: dict[tuple[str, str, str, str], tuple[float, bool]] = {}

    async def authenticate(self, header: str | None) -> Caller:
        if not header or not header.lower().startswith("bearer "):
            raise AuthError(401, "Unauthorized", "a bearer token is required")
        token = header[7:].strip()
        key = hashlib.sha256(token.encode()).hexdigest()
        cached = self._tokens.get(key)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        spec: dict[str, Any] = {"token": token}
        if self.audience:
            spec["audiences"] = [self.audience]
        review = await self.kube.create("/apis/authentication.k8s.io/v1/tokenreviews",
                                        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec})
        status = review.get("status") or {}
        if not status.get("authenticated"):
            raise AuthError(401, "Unauthorized", "the token is not valid" +
                            (f" for audience {self.audience}" if self.audience else ""))
        if self.audience and self.audience not in (status.get("audiences") or []):
            raise AuthError(401, "Unauthorized", f"the token is not meant for audience {self.audience}")
        user = status.get("user") or {}
        caller = Caller(username=user.get("username", ""), uid=user.get("uid", ""),
                        groups=tuple(user.get("groups") or []), extra=user.get("extra") or {})
        self._tokens[key] = (time.monotonic() + CACHE_SECONDS, caller)
        return caller

    async def authorize(self, caller: Caller, namespace: str, name: str, verb: str = "claim") -> None:
        key = (caller.username, namespace, name, verb)
        cached = self._access.get(key)
        if cached is not None and cached[0] > time.monotonic():
            allowed = cached[1]
        else:
            review = await self.kube.create("/apis/authorization.k8s.io/v1/subjectaccessreviews", {
                "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                "spec": {"user": caller.username, "uid": caller.uid, "groups": list(caller.groups),
                         "extra": caller.extra,
                         "resourceAttributes": {"namespace": namespace, "verb": verb, "group": "tether.dev",
                                                "resource": "workerruns", "name": name}}})
            allowed = bool((review.get("status") or {}).get("allowed"))
            self._access[key] = (time.monotonic() + CACHE_SECONDS, allowed)
        if not allowed:
            raise AuthError(403, "Forbidden", f"{caller.username} may not {verb} workerruns/{name} in {namespace}")
