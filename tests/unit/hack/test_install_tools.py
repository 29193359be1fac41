"""`make install-tools` uses a helm and a kubectl already on PATH, building neither (hack/install-tools.sh),
and the own-cluster path's targets build no Kubernetes and install no browser."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[3]


def test_tools_on_path_are_used_and_nothing_is_built(tmp_path: Path) -> None:
    bin_dir, cache, prefix = tmp_path / "bin", tmp_path / "cache", tmp_path / "prefix"
    bin_dir.mkdir()
    cache.mkdir()
    for tool in ("helm", "kubectl"):
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / tool).chmod(0o755)
    out = subprocess.run(["bash", str(ROOT / "hack" / "install-tools.sh"), str(prefix)], check=True, text=True,
                         stdout=subprocess.PIPE, env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin",
                                                      "TETHER_CACHE": str(cache)}, timeout=60)
    assert out.stdout.splitlines() == [f"helm: using {bin_dir}/helm (on PATH)", f"kubectl: using {bin_dir}/kubectl (on PATH)"]
    assert list(cache.iterdir()) == [] and list((prefix / "bin").iterdir()) == []


MAKEFILE = (ROOT / "Makefile").read_text()
# target: prerequisites (rules only: no variable assignments)
RULES = {m[0]: m[1].split() for m in re.findall(r"(?m)^([a-z][\w-]*):(?!=)([^\n]*)$", MAKEFILE)}


def _closure(target: str) -> set[str]:
    seen, todo = set(), [target]
    while todo:
        if (t := todo.pop()) not in seen:
            seen.add(t)
            todo += RULES.get(t, [])
    return seen


@pytest.mark.parametrize("target", ["install", "install-plugin", "install-tools", "plugin"])
def test_the_own_cluster_path_builds_no_kubernetes_and_installs_no_browser(target: str) -> None:
    assert not {"control-plane", "browser", "node", "kind-image", "tools"} & _closure(target)
    (install,) = re.findall(r"(?m)^install:.*\n((?:\t.*\n)*)", MAKEFILE)
    assert "install-browser" not in install
