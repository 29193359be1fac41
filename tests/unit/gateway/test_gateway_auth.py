"""The gateway's authentication caches (TokenReview and SubjectAccessReview answers)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.unit


def test_the_gateways_token_caches_are_bounded_and_remember_refusals() -> None:
    """Anyone may present tokens to the gateway (and its console's sign-in): neither a flood of
    distinct tokens grows its memory, nor one bogus token costs a TokenReview per request."""
    import asyncio

    from tether.gateway import auth

    from testkit.fakeapi import FakeApi, Request

    reviews: list[str] = []

    def review(req: Request) -> tuple[int, dict[str, Any]]:
        reviews.append(req.body["spec"]["token"])
        ok = req.body["spec"]["token"].startswith("good")
        return 201, {"status": {"authenticated": ok, "user": {"username": "u"}}}

    api = FakeApi()
    api.before(review)
    a = auth.Authenticator(api.client(), audience=None)

    async def go() -> None:
        for _ in range(3):
            with pytest.raises(auth.AuthError):
                await a.authenticate("Bearer bogus")
        assert reviews == ["bogus"]
        for i in range(auth.CACHE_ENTRIES + 10):
            await a.authenticate(f"Bearer good-{i}")
        assert len(a._tokens._items) == auth.CACHE_ENTRIES

    asyncio.run(go())
