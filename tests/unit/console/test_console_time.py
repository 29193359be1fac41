"""The console says times the way people do: a deadline an hour ahead is "in 1h", not "in 3563s"
(its script ticks ages in the browser; the server renders durations with the same scale)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tether.console.details import duration, what_starts

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[3] / "operator" / "tether" / "console" / "static" / "console.js"
# console.js run in a sandbox with just enough of a page for its top level (node: the SDK tests' runtime).
HARNESS = """
const vm = require("vm"), fs = require("fs");
const el = () => ({dataset: {}, addEventListener() {}, querySelectorAll: () => []});
const ctx = {document: {body: el(), getElementById: () => null, addEventListener() {}, querySelectorAll: () => []},
             setInterval() {}, EventSource: function () { this.addEventListener = () => {}; }, window: {},
             location: {}, console};
vm.createContext(ctx);
vm.runInContext(fs.readFileSync(process.argv[1], "utf8") + ";globalThis.age = age;", ctx);
console.log(JSON.stringify(JSON.parse(process.argv[2]).map((s) => ctx.age(s))));
"""

CASES = [(42, "42s ago"), (-42, "in 42s"), (-3563, "in 59m"), (7300, "2h ago"), (-3 * 86400, "in 3d")]


def test_the_scripts_ages_and_deadlines_read_as_people_say_them() -> None:
    out = subprocess.run(["node", "-e", HARNESS, str(SCRIPT), json.dumps([s for s, _ in CASES])],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [said for _, said in CASES]


def test_a_start_gates_deadline_is_said_in_hours_not_seconds() -> None:
    assert [duration(s) for s in (90, 3563, 7300, 3 * 86400)] == ["90s", "59m", "2h", "3d"]
    assert "deadline 60m" in what_starts({"spec": {"deadlineSeconds": 3600}})
    assert "deadline 3d" in what_starts({"spec": {"deadlineSeconds": 3 * 86400}})
