"""hack/lib.sh's apt_install on a machine whose package manager a killed install left interrupted:
apt-get refuses everything until `dpkg --configure -a` has run (a first `make test` stopped there).
Driven with stand-ins for apt-get and dpkg on PATH that keep dpkg's state in a directory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
APT_GET = """#!/usr/bin/env bash
echo "apt-get $*" >> "$STATE/calls"
case "$1" in
  update) exit 0 ;;
  install)
    if [[ -f "$STATE/interrupted" ]]; then
      echo "E: dpkg was interrupted, you must manually run 'dpkg --configure -a' to correct the problem." >&2
      exit 100
    fi
    touch "$STATE/installed"; exit 0 ;;
esac
"""
DPKG = """#!/usr/bin/env bash
echo "dpkg $*" >> "$STATE/calls"
[[ "$*" == "--configure -a" ]] && rm -f "$STATE/interrupted"
exit 0
"""


def _apt_install(tmp_path: Path, interrupted: bool) -> tuple[int, list[str]]:
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    for name, script in (("apt-get", APT_GET), ("dpkg", DPKG)):
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    if interrupted:
        (state / "interrupted").touch()
    # Sourced from hack/ (lib.sh finds versions.env next to its caller, here the working directory).
    done = subprocess.run(["bash", "-c", f'source "{ROOT}/hack/lib.sh" && apt_install chromium'],
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STATE": str(state)},
                          cwd=ROOT / "hack", capture_output=True, text=True)
    calls = (state / "calls").read_text().splitlines() if (state / "calls").exists() else []
    return done.returncode if (state / "installed").exists() else -1, calls


def test_an_interrupted_package_manager_is_finished_before_the_install_is_retried(tmp_path: Path) -> None:
    code, calls = _apt_install(tmp_path, interrupted=True)
    assert code == 0, calls
    assert calls == ["apt-get install -y -q chromium", "dpkg --configure -a", "apt-get update -q",
                     "apt-get install -y -q chromium"]


def test_a_healthy_package_manager_installs_at_once(tmp_path: Path) -> None:
    code, calls = _apt_install(tmp_path, interrupted=False)
    assert code == 0 and calls == ["apt-get install -y -q chromium"]
