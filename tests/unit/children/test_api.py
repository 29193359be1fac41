"""A child's name: stable for (parent UID, key, generation), another for a namesake parent, a valid
run name at any parent name; the vectors the TypeScript and Go SDKs will pass are these."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tether.children.api import child_name, spawn_digest, valid_key

VECTORS = Path(__file__).parents[3] / "sdk" / "vectors" / "children.json"


def test_the_name_is_the_parents_cut_and_a_digest_of_its_uid_and_the_key() -> None:
    a = child_name("planner", "u-1", "search:1")
    assert a == child_name("planner", "u-1", "search:1") and a.startswith("planner-") and len(a) == len("planner-") + 10
    assert a != child_name("planner", "u-2", "search:1")  # a namesake parent's children are others
    assert a != child_name("planner", "u-1", "search:2") != child_name("planner", "u-1", "search:1", generation=1)
    long = child_name("p" * 58, "u-1", "k")
    assert len(long) == 58 and long.startswith("p" * 47 + "-")
    assert child_name("a" * 46 + "-.b", "u", "k").startswith("a" * 46 + "-")  # no "-.-" or ".-" in a name


@pytest.mark.parametrize("key, ok", [("search:1", True), ("a", True), ("tool/call.7_x-y", True),
                                     ("", False), ("-a", False), ("a b", False), ("a#1", False), ("k" * 129, False),
                                     ("abc\n", False)])
def test_a_key_is_a_stable_name_of_one_call(key: str, ok: bool) -> None:
    assert valid_key(key) is ok
    if not ok:
        with pytest.raises(ValueError):
            child_name("p", "u", key)


def test_the_digest_is_of_the_spec_whatever_its_keys_order() -> None:
    assert spawn_digest({"a": 1, "b": {"c": [1, 2]}}) == spawn_digest({"b": {"c": [1, 2]}, "a": 1})
    assert spawn_digest({"a": 1}) != spawn_digest({"a": 2})


def test_the_cross_sdk_vectors_are_what_the_python_sdk_computes() -> None:
    vectors = json.loads(VECTORS.read_text())
    assert len(vectors["names"]) >= 5 and len(vectors["digests"]) >= 2
    for v in vectors["names"]:
        assert child_name(v["parent"], v["uid"], v["key"], v.get("generation", 0)) == v["name"], v
    for v in vectors["digests"]:
        assert spawn_digest(v["spec"]) == v["digest"], v


def test_the_parent_and_child_body_vectors_are_what_the_python_sdk_makes() -> None:
    from tether.children.bodies import Parent, child_body, child_spec
    vectors = json.loads(VECTORS.read_text())
    parents = [Parent.of(p["run"]) for p in vectors["parents"]]
    for p, got in zip(vectors["parents"], parents):
        want = p["parent"]
        assert (got.name, got.uid, got.class_name, got.depth, got.budget_ref, got.capped_cents, got.capped_tokens) == (
            want["name"], want["uid"], want["className"], want["depth"], want["budgetRef"], want["cappedCents"],
            want["cappedTokens"]), p
    assert any("refused" in b for b in vectors["bodies"]) and sum("body" in b for b in vectors["bodies"]) >= 3
    for b in vectors["bodies"]:
        parent, ask = parents[b["parent"]], b["ask"]
        if "refused" in b:
            with pytest.raises(ValueError, match="names its share"):
                child_spec(parent, ask["className"], ask["payload"], ask["capCents"], ask["maxTokens"], ask["spec"])
            continue
        spec = child_spec(parent, ask["className"], ask["payload"], ask["capCents"], ask["maxTokens"], ask["spec"])
        assert spec == b["spec"]
        assert child_body(parent, "team-a", b["holder"], b["fence"], b["key"], b["generation"], spec) == b["body"]
