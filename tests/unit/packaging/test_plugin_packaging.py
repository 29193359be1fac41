"""kubectl-tether as users install it (packaging/kubectl-tether, `make plugin`, krew/tether.yaml):
a wheel with only the plugin's dependencies, a reproducible krew archive whose sha256 the
manifest carries, and a launcher that installs itself on first use."""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("plugin_build", ROOT / "packaging" / "kubectl-tether" / "build.py")
assert spec is not None and spec.loader is not None
build = importlib.util.module_from_spec(spec)
sys.modules["plugin_build"] = build  # its dataclass looks itself up there
spec.loader.exec_module(build)

pytestmark = pytest.mark.unit

# What the plugin's commands import: each has to work with only the wheel's requirements.
PLUGIN_MODULES = ["tether.plugin", "tether.release_finalizers", "tether.console.local"]


def _requirement_closure(names: list[str]) -> set[str]:
    """Distributions pulled in by `names`, extras left out (as `pip install kubectl-tether` does)."""
    seen: set[str] = set()
    todo = [n.lower() for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # a marker leaves it out here (e.g. a backport for older Pythons)
        for req in requires:
            if "extra ==" not in req:
                todo.append(build._requirement_name(req).replace("_", "-"))
    return seen


def test_the_plugin_needs_only_the_wheels_requirements() -> None:
    """Everything outside the requirements' closure is made uninstalled; the plugin still imports."""
    dists = _requirement_closure(list(build.PLUGIN_DEPENDENCIES))
    allowed = sorted({mod for mod, owners in md.packages_distributions().items()
                      if any(o.lower().replace("_", "-") in dists for o in owners)} | {"tether"})
    probe = f"""
import sys
allowed = set({allowed!r}) | set(sys.stdlib_module_names)
class Uninstalled:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in allowed and not top.startswith("_"):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Uninstalled())
import {", ".join(PLUGIN_MODULES)}
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT / "operator")
    assert done.returncode == 0, done.stderr
    for heavy in ("kopf", "cryptography"):  # (the kubernetes package is the plugin's kubeconfig loader)
        assert heavy not in dists


def _manifest_problems(manifest: dict[str, Any], name: str) -> list[str]:
    """krew's structural checks of a Plugin manifest (pkg/index/validation)."""
    problems = []
    if manifest.get("apiVersion") != "krew.googlecontainertools.github.com/v1alpha2" or manifest.get("kind") != "Plugin":
        problems.append("apiVersion/kind")
    if manifest.get("metadata", {}).get("name") != name or not re.fullmatch(r"[\w-]+", name):
        problems.append("name must match the file name")
    spec_ = manifest.get("spec") or {}
    if not spec_.get("shortDescription"):
        problems.append("shortDescription")
    if not re.fullmatch(r"v\d+\.\d+\.\d+(-[\w.]+)?", str(spec_.get("version", ""))):
        problems.append("version: semver with a v")
    if not spec_.get("platforms"):
        problems.append("platforms")
    for p in spec_.get("platforms") or []:
        if not str(p.get("uri", "")).startswith("https://"):
            problems.append("uri")
        if not re.fullmatch(r"[a-f0-9]{64}", str(p.get("sha256", ""))):
            problems.append("sha256")
        if not p.get("bin"):
            problems.append("bin")
        if "files" in p and not all(f.get("from") and f.get("to") for f in p["files"] or [None]):
            problems.append("files")
        selector = p.get("selector") or {}
        keys = list(selector.get("matchLabels") or {}) + [e["key"] for e in selector.get("matchExpressions") or []]
        if not keys or set(keys) - {"os", "arch"}:
            problems.append("selector: os/arch only, not empty")
    return problems


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build.build(tmp_path_factory.mktemp("dist"))


def test_the_krew_manifest_names_the_archive_make_plugin_builds(built: Any, tmp_path: Path) -> None:
    committed_text = build.MANIFEST.read_text()
    assert _manifest_problems(yaml.safe_load(committed_text), build.MANIFEST.stem) == []
    rendered_text = build.render_manifest(committed_text, built)
    rendered = yaml.safe_load(rendered_text)
    assert _manifest_problems(rendered, "tether") == []
    platform, = rendered["spec"]["platforms"]
    assert platform["sha256"] == hashlib.sha256(built.archive.read_bytes()).hexdigest()
    assert platform["uri"].endswith(f"/v{built.version}/{built.archive.name}")
    assert rendered["spec"]["version"] == f"v{built.version}"
    # The committed manifest is the rendered one but for the sha256 (refreshed at a release).
    strip = lambda text: re.sub(r"(?m)^    sha256: .*$", "", text)  # noqa: E731
    assert strip(rendered_text) == strip(committed_text)
    # Reproducible: another build of the same tree has the same bytes.
    again = build.build(tmp_path)
    assert again.sha256 == built.sha256
    # What krew extracts and links: every `from` matches, and `bin` is the executable launcher.
    with tarfile.open(built.archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
    for f in platform["files"]:
        assert fnmatch.filter(members, f["from"]), f["from"]
    assert members[platform["bin"]].mode & 0o111


def test_the_wheel_is_kubectl_tether_with_the_plugins_requirements(built: Any) -> None:
    with zipfile.ZipFile(built.wheel) as whl:
        info = f"kubectl_tether-{built.version}.dist-info"
        metadata = whl.read(f"{info}/METADATA").decode()
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
        names = whl.namelist()
    assert "Name: kubectl-tether" in metadata
    requires = sorted(line.removeprefix("Requires-Dist: ") for line in metadata.splitlines()
                      if line.startswith("Requires-Dist: "))
    assert {build._requirement_name(r) for r in requires} == set(build.PLUGIN_DEPENDENCIES)
    assert entry_points.splitlines() == ["[console_scripts]", "kubectl-tether = tether.plugin:main"]
    assert {"tether/plugin.py", "tether/release_finalizers.py", "tether/console/static/console.js"} <= set(names)


def test_the_krew_launcher_installs_itself_once(built: Any, tmp_path: Path) -> None:
    store = tmp_path / "store" / "tether" / f"v{built.version}"
    store.mkdir(parents=True)
    with tarfile.open(built.archive) as tar:
        tar.extractall(store, filter="data")
    (tmp_path / "bin").mkdir()
    link = tmp_path / "bin" / "kubectl-tether"
    link.symlink_to(store / "kubectl-tether")  # krew links its bin directory to the store
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "TETHER_PYTHON": sys.executable}
    first = subprocess.run([str(link), "--help"], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "release-finalizers" in first.stdout and "first run" in first.stderr
    second = subprocess.run([str(link), "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert second.returncode == 0 and second.stderr == ""
    # Its private virtualenv holds the plugin and its requirements, not the operator's.
    listed = subprocess.run([str(store / "venv" / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                            capture_output=True, text=True, check=True).stdout
    installed = {p["name"].lower() for p in json.loads(listed)}
    assert "kubectl-tether" in installed and not installed & {"kopf", "cryptography"}
