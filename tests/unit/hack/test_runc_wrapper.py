"""hack/kind/runc-wrapper: CAP_SYS_RESOURCE out of the spec runc reads, nothing else changed."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

WRAPPER = Path(__file__).resolve().parents[3] / "hack" / "kind" / "runc-wrapper"
CAPS = ["CAP_CHOWN", "CAP_SYS_RESOURCE", "CAP_SYS_TIME"]


def _spec(caps: list[str]) -> dict[str, object]:
    # 2^63 - 1 as Docker writes an unlimited rlimit: a parser through doubles would round it.
    return {"process": {"args": ["sh"], "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 9223372036854775807}],
                        "capabilities": {k: list(caps) for k in ("bounding", "effective", "permitted")}},
            "root": {"path": "rootfs"}}


def _run(tmp_path: Path, *args: str) -> list[str]:
    fake = tmp_path / "runc"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    fake.chmod(0o755)
    out = tmp_path / "args"
    subprocess.run([str(WRAPPER), *args], check=True, cwd=tmp_path,
                   env={**os.environ, "TETHER_REAL_RUNC": str(fake), "ARGS_OUT": str(out)})
    return out.read_text().splitlines()


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "indented"])
def test_create_takes_the_capability_out_of_every_set_and_keeps_the_rest_byte_for_byte(
        tmp_path: Path, compact: bool) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    text = json.dumps(_spec(CAPS), separators=(",", ":")) if compact else json.dumps(_spec(CAPS), indent=2)
    (bundle / "config.json").write_text(text)
    argv = ["--root", "/run/x", "--log", "/tmp/log", "--log-format", "json", "create",
            "--pid-file", "/tmp/pid", "--bundle", str(bundle), "ctr-1"]
    assert _run(tmp_path, *argv) == argv  # runc gets the same arguments
    after = (bundle / "config.json").read_text()
    assert json.loads(after) == _spec(["CAP_CHOWN", "CAP_SYS_TIME"])
    assert "9223372036854775807" in after


def test_a_lone_capability_leaves_an_empty_set(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_spec(["CAP_SYS_RESOURCE"])))
    _run(tmp_path, "run", "ctr-2")  # no --bundle: runc's default is the working directory
    assert json.loads((tmp_path / "config.json").read_text()) == _spec([])


def test_exec_edits_its_process_file_and_not_the_bundle(tmp_path: Path) -> None:
    process = tmp_path / "process.json"
    process.write_text(json.dumps({"args": ["ls"], "capabilities": {"bounding": CAPS}}))
    (tmp_path / "config.json").write_text(json.dumps(_spec(CAPS)))
    _run(tmp_path, "--root", "/run/x", "exec", "--process", str(process), "--detach", "ctr-3")
    assert json.loads(process.read_text())["capabilities"]["bounding"] == ["CAP_CHOWN", "CAP_SYS_TIME"]
    assert json.loads((tmp_path / "config.json").read_text()) == _spec(CAPS)


def test_a_spec_without_the_capability_and_other_commands_are_untouched(tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    bundle.mkdir()
    text = json.dumps(_spec(["CAP_CHOWN"]), indent=1)
    (bundle / "config.json").write_text(text)
    _run(tmp_path, "create", "--bundle", str(bundle), "ctr-4")
    assert (bundle / "config.json").read_text() == text
    (tmp_path / "config.json").write_text(json.dumps(_spec(CAPS)))
    for argv in (["state", "create"], ["delete", "--force", "run"], ["features"]):  # ids that look like commands
        assert _run(tmp_path, *argv) == argv
    assert json.loads((tmp_path / "config.json").read_text()) == _spec(CAPS)
