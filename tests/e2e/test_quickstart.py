"""The acceptance test of issue 22: the README's quick start, as written, from a fresh HOME.

It runs the one bash block between `<!-- quickstart:begin -->` and `<!-- quickstart:end -->`
with `bash -euo pipefail` (the local cluster, the Helm install with defaults, a first run to
Succeeded, `kubectl tether` from where the quick start installed it), then the Uninstall block
of docs/install.md in its documented order. Any failing command fails the test. The quick start
starts a control plane of its own (`tether dev cluster`); the test stops it, with everything
the script left running, by its process group."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = re.compile(r"<!-- quickstart:begin -->\s*```bash\n(.*?)```\s*<!-- quickstart:end -->", re.S)
# Everything the script may take: the first `make` builds nothing when the cache is warm.
TIMEOUT_SECONDS = 900

pytestmark = pytest.mark.local_cluster  # the quick start starts the local control plane


def quickstart_block(readme: str) -> str:
    blocks = QUICKSTART.findall(readme)
    assert len(blocks) == 1, "README.md needs one ```bash block between the quickstart markers"
    return blocks[0]


def uninstall_block(install_md: str) -> str:
    section = install_md.split("\n## Uninstall\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)[0]


def test_the_blocks_are_found() -> None:
    block = quickstart_block((ROOT / "README.md").read_text())
    assert "helm install" in block and "kubectl tether" in block
    assert "helm uninstall" in uninstall_block((ROOT / "docs" / "install.md").read_text())


def _user_env(home: Path) -> dict[str, str]:
    """A new user's environment: a fresh HOME, a PATH without this checkout's virtualenv or the
    build cache. The caches stay where they are (the control plane and helm are not rebuilt), and
    pyenv's shims, if python3 comes from them, keep finding their versions."""
    real_home = Path.home()
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("TETHER_", "KUBECONFIG", "VIRTUAL_ENV", "PYTEST", "HELM_"))}
    path = [p for p in os.environ["PATH"].split(os.pathsep)
            if not p.startswith(str(ROOT)) and ".cache/tether" not in p]
    keep.update(HOME=str(home), PATH=os.pathsep.join(path),
                TETHER_CACHE=os.environ.get("TETHER_CACHE", str(real_home / ".cache" / "tether")),
                PIP_CACHE_DIR=str(real_home / ".cache" / "pip"),
                GOMODCACHE=os.environ.get("GOMODCACHE", str(real_home / "go" / "pkg" / "mod")),
                GOCACHE=os.environ.get("GOCACHE", str(real_home / ".cache" / "go-build")))
    if (real_home / ".pyenv").is_dir():
        keep.setdefault("PYENV_ROOT", str(real_home / ".pyenv"))
    return keep


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """The script's background `tether dev cluster` outlives it: SIGTERM stops it and removes its state."""
    for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def test_the_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    where = tmp_path / "kubectl-tether-path"
    script = tmp_path / "quickstart.sh"
    script.write_text("\n".join([
        quickstart_block((ROOT / "README.md").read_text()),
        f"command -v kubectl-tether > {where}",  # where `kubectl tether` came from
        "kubectl get wr short-job -o jsonpath='{.status.phase}{\"\\n\"}'",
        uninstall_block((ROOT / "docs" / "install.md").read_text()),
        "test -z \"$(kubectl get workerruns --all-namespaces -o name)\"",
        "if helm status tether --namespace tether-system >/dev/null 2>&1; then exit 1; fi  # uninstalled",
    ]))
    # A previous run's leftovers (a second run in the same checkout): its cluster is gone. The quick
    # start once read them before its new cluster had written anything, and helm found no cluster.
    (ROOT / ".tether").mkdir(exist_ok=True)
    (ROOT / ".tether" / "cluster.env").write_text(f"export KUBECONFIG={tmp_path / 'gone' / 'kubeconfig'}\n"
                                                   f"export PATH={tmp_path / 'gone'}:$PATH\n")
    log = tmp_path / "quickstart.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", str(script)], cwd=ROOT, env=_user_env(home),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _stop_group(proc)
    output = log.read_text(errors="replace")
    assert code == 0, f"the quick start failed (exit {code}):\n{output[-6000:]}"
    assert re.search(r"short-job: Succeeded\s+attempt 1", output), output[-3000:]
    # The plugin from where the quick start installed it, not this checkout's virtualenv.
    plugin = Path(where.read_text().strip())
    assert plugin.is_relative_to(home), f"kubectl tether ran from {plugin}"
