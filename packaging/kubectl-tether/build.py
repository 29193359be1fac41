"""`make plugin`: the kubectl-tether distribution and its krew archive, reproducibly.

kubectl-tether is the repository's `tether` package with only the dependencies the plugin's
commands import (the operator's kopf and cryptography stay out; the `kubernetes` package comes
along for its kubeconfig loader: exec credential plugins, merged files, contexts), so that
`pipx install kubectl-tether` stays small. Its versions come from the root pyproject.toml: one
place for the version and the dependency bounds. The krew archive holds the wheel and a
launcher (launcher.sh); the krew manifest (krew/tether.yaml) is rendered beside it with the
archive's sha256 and release URL: OUT/tether.yaml, the one to publish. A release writes it back
into krew/tether.yaml (--manifest-out krew/tether.yaml); other builds leave the tree alone.

  python packaging/kubectl-tether/build.py [--out dist] [--manifest-out PATH]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NAME = "kubectl-tether"
# The third-party imports of `tether.plugin` and its commands (ui included); a unit test checks
# that the plugin imports nothing else outside the standard library.
PLUGIN_DEPENDENCIES = ("httpx", "sniffio", "pydantic", "pyyaml", "prometheus-client", "starlette", "uvicorn",
                       "kubernetes")
# Fixed timestamps in the wheel (SOURCE_DATE_EPOCH) and the archive: the same tree, the same bytes.
EPOCH = 315532800  # 1980-01-01, the earliest a zip can say
MANIFEST = ROOT / "krew" / "tether.yaml"
RELEASES = "https://github.com/tether-dev/tether/releases/download"


@dataclass(frozen=True)
class Built:
    wheel: Path
    archive: Path
    sha256: str
    version: str


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower()


def plugin_requirements(meta: dict) -> list[str]:
    reqs = [r for r in meta["dependencies"] if _requirement_name(r) in PLUGIN_DEPENDENCIES]
    missing = set(PLUGIN_DEPENDENCIES) - {_requirement_name(r) for r in reqs}
    if missing:
        raise SystemExit(f"pyproject.toml no longer lists {sorted(missing)}: update PLUGIN_DEPENDENCIES")
    return reqs


def _pyproject(meta: dict) -> str:
    deps = ",\n".join(f"  {r!r}" for r in plugin_requirements(meta)).replace("'", '"')
    return f'''[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "{NAME}"
version = "{meta["version"]}"
description = "kubectl tether: status, stop, suspend, resume, approvals, the console and release-finalizers for Tether's WorkerRuns."
readme = "README.md"
requires-python = "{meta["requires-python"]}"
license = "{meta["license"]}"
dependencies = [
{deps},
]

[project.scripts]
kubectl-tether = "tether.plugin:main"

[tool.setuptools.packages.find]
include = ["tether*"]

[tool.setuptools.package-data]
tether = ["py.typed", "console/static/*"]
'''


def stage(dest: Path) -> None:
    """A source tree for the wheel: the package, this README, the licence, a pyproject of its own."""
    shutil.copytree(ROOT / "operator" / "tether", dest / "tether", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(HERE / "README.md", dest / "README.md")
    shutil.copy(ROOT / "LICENSE", dest / "LICENSE")
    (dest / "pyproject.toml").write_text(_pyproject(project()))


def build_wheel(out: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        stage(src)
        env = {**os.environ, "SOURCE_DATE_EPOCH": str(EPOCH)}
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(src)],
                       check=True, env=env, cwd=tmp)
    version = project()["version"]
    return out / f"kubectl_tether-{version}-py3-none-any.whl"


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, EPOCH
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def build_archive(wheel: Path, out: Path) -> Path:
    """kubectl-tether-VERSION.tar.gz: the launcher (krew's `bin`), the wheel, the licence."""
    archive = out / f"{NAME}-{project()['version']}.tar.gz"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "LICENSE", (ROOT / "LICENSE").read_bytes(), 0o644)
        _add(tar, NAME, (HERE / "launcher.sh").read_bytes(), 0o755)
        _add(tar, wheel.name, wheel.read_bytes(), 0o644)
    with archive.open("wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=EPOCH, filename="") as gz:
        gz.write(raw.getvalue())
    return archive


def build(out: Path) -> Built:
    out.mkdir(parents=True, exist_ok=True)
    wheel = build_wheel(out)
    archive = build_archive(wheel, out)
    return Built(wheel, archive, hashlib.sha256(archive.read_bytes()).hexdigest(), project()["version"])


def render_manifest(text: str, built: Built) -> str:
    """The krew manifest for this build: its version, its release's archive URL and sha256."""
    uri = f"{RELEASES}/v{built.version}/{built.archive.name}"
    text = re.sub(r'(?m)^(  version: ).*$', rf'\g<1>"v{built.version}"', text)
    text = re.sub(r'(?m)^(    uri: ).*$', rf"\g<1>{uri}", text)
    return re.sub(r'(?m)^(    sha256: ).*$', rf'\g<1>"{built.sha256}"', text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "dist")
    parser.add_argument("--manifest-out", type=Path, default=None,
                        help="where the krew manifest for this build goes (default: OUT/tether.yaml)")
    args = parser.parse_args(argv)
    built = build(args.out.resolve())
    manifest = args.manifest_out or args.out / "tether.yaml"
    manifest.write_text(render_manifest(MANIFEST.read_text(), built))
    print(f"{built.wheel}\n{built.archive}  sha256 {built.sha256}\n{manifest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
