"""The operator's WorkerClasses (controller/classes.py): no unpinned run is decided before every
class is known, and a list that raced the watch never brings back what the watch said is gone."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tether.controller.classes import ClassBook
from tether.kube.client import NotFound

pytestmark = pytest.mark.unit


def klass(name: str, rv: str = "1", lease: int = 20) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": rv},
            "spec": {"defaults": {"lease": {"durationSeconds": lease, "renewIntervalSeconds": 5}}}}


def run(class_name: str | None = None, **status: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"executor": "External"}
    if class_name:
        spec["className"] = class_name
    return {"metadata": {"name": "r", "namespace": "ns", "uid": "u"}, "spec": spec, "status": status}


def test_a_sync_lists_every_class_once() -> None:
    book = ClassBook()
    assert not book.synced

    async def listed() -> list[dict[str, Any]]:
        return [klass("a"), klass("b")]

    asyncio.run(book.sync(listed))
    assert book.synced and set(book.classes) == {"a", "b"}


def test_what_the_watch_says_during_the_list_is_newer_than_the_list() -> None:
    book = ClassBook()
    book.on_event("ADDED", klass("gone"))

    async def listed() -> list[dict[str, Any]]:
        # While the list is on its way: one class deleted, another edited.
        book.on_event("DELETED", klass("gone"))
        book.on_event("MODIFIED", klass("edited", rv="9", lease=30))
        return [klass("gone"), klass("edited", rv="5", lease=20), klass("new")]

    asyncio.run(book.sync(listed))
    assert set(book.classes) == {"edited", "new"}
    assert book.classes["edited"].defaults["lease"]["durationSeconds"] == 30


def test_no_class_crd_is_no_class() -> None:
    book = ClassBook()

    async def listed() -> list[dict[str, Any]]:
        raise NotFound(404, "the server could not find the requested resource", "list workerclasses")

    asyncio.run(book.sync(listed))
    assert book.synced and book.classes == {}


def test_a_failed_list_leaves_it_unsynced() -> None:
    book = ClassBook()

    async def listed() -> list[dict[str, Any]]:
        raise ConnectionError("refused")

    with pytest.raises(ConnectionError):
        asyncio.run(book.sync(listed))
    assert not book.synced
    book.on_event("ADDED", klass("a"))  # the watch goes on as before
    assert set(book.classes) == {"a"}


def test_run_of_resolves_unpinned_runs_against_the_classes_and_pinned_ones_against_their_record() -> None:
    book = ClassBook()

    async def listed() -> list[dict[str, Any]]:
        return [klass("a", lease=20)]

    asyncio.run(book.sync(listed))
    parsed, resolution = book.run_of(run("a"))
    assert resolution is not None and resolution.name == "a"
    assert parsed.spec.lease.duration_seconds == 20
    pinned = run("a", attempt=1, **{"class": {"name": "a", "defaults": {"lease": {"durationSeconds": 40}}}})
    parsed, resolution = book.run_of(pinned)
    assert resolution is None and parsed.spec.lease.duration_seconds == 40


def test_a_refused_list_leaves_unpinned_runs_waiting_with_the_reason_and_is_tried_again() -> None:
    from tether.kube.client import Forbidden

    book = ClassBook()

    async def refused() -> list[dict[str, Any]]:
        raise Forbidden(403, '{"message": "workerclasses is forbidden"}', "list workerclasses")

    asyncio.run(book.sync(refused))
    assert not book.synced and book.unlisted is not None and "403" in book.unlisted
    _, resolution = book.run_of(run("a"))
    assert resolution is not None and resolution.unknown is not None and "forbidden" in resolution.unknown
    # A pinned run is not held by it.
    assert book.run_of(run("a", attempt=1))[1] is None

    async def listed() -> list[dict[str, Any]]:
        return [klass("a")]

    asyncio.run(book.sync(listed))
    assert book.synced and book.unlisted is None and book.run_of(run("a"))[1].unknown is None  # type: ignore[union-attr]


def test_concurrent_syncs_list_once() -> None:
    book = ClassBook()
    calls = []

    async def listed() -> list[dict[str, Any]]:
        calls.append(1)
        await asyncio.sleep(0.01)
        return [klass("a")]

    async def both() -> None:
        await asyncio.gather(book.sync(listed), book.sync(listed))

    asyncio.run(both())
    assert calls == [1] and set(book.classes) == {"a"}
