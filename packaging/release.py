"""`make release`: every artefact a release publishes, built into dist/ from this tree.

  dist/images/tether-VERSION.oci.tar          the operator image (OCI image layout, also `docker load`-able)
  dist/images/example-worker-VERSION.oci.tar  the examples' worker image (the same image today)
  dist/tether-VERSION.tgz                     the Helm chart, its image pinned to the operator's digest
  dist/kubectl_tether-VERSION-py3-none-any.whl, dist/kubectl-tether-VERSION.tar.gz, dist/tether.yaml
                                              the plugin's wheel, its krew archive and manifest
  dist/images.txt                             each image's reference with its digest
  dist/SHA256SUMS                             `sha256sum -c SHA256SUMS`

Reproducible: the same tree and the same image build give the same bytes. `docker save` and
`helm package` stamp the time of the build (layer mtimes, the image's `created`, the chart's tar
headers), so both are rewritten here with SOURCE_DATE_EPOCH (default: the last commit's time), as
BuildKit's `rewrite-timestamp` does; skopeo or crane would copy an archive but keep its times.

  python packaging/release.py [--out dist]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REGISTRY = "ghcr.io/tether-dev"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
# Docker's own build bookkeeping in an image config: the build container's id and host name change
# on every build and mean nothing to a runtime.
_BUILD_ONLY_CONFIG_KEYS = ("container", "container_config", "docker_version")
_TIME_PAX_KEYS = ("mtime", "atime", "ctime")


@dataclass(frozen=True)
class Blob:
    digest: str  # sha256:...
    size: int
    path: Path


@dataclass(frozen=True)
class Image:
    """An image as OCI blobs in a directory: its manifest, and the platform its config names."""
    manifest: Blob
    platform: dict[str, str]
    blobs: Path


def version() -> str:
    import tomllib
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def source_date_epoch() -> int:
    given = os.environ.get("SOURCE_DATE_EPOCH")
    if given:
        return int(given)
    out = subprocess.run(["git", "log", "-1", "--format=%ct"], cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True)
    return int(out.stdout.strip())


def _rfc3339(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _store(blobs: Path, data: bytes) -> Blob:
    digest = hashlib.sha256(data).hexdigest()
    path = blobs / digest
    path.write_bytes(data)
    return Blob(f"sha256:{digest}", len(data), path)


def _clamp_member(member: tarfile.TarInfo, epoch: int) -> tarfile.TarInfo:
    # Every time, earlier ones too: files copied from a checkout carry its times, which differ
    # between two clones of one commit.
    member.mtime = epoch
    member.pax_headers = {k: v for k, v in member.pax_headers.items() if k not in _TIME_PAX_KEYS}
    return member


def _normalized_layer(source: BinaryIO, blobs: Path, epoch: int) -> tuple[Blob, str]:
    """A layer with every time set to the epoch, gzipped without a timestamp: (blob, diff_id). (The
    gzip bytes are those of this Python's zlib: the same build host gives the same bytes.)"""
    with tempfile.TemporaryFile(dir=blobs) as raw:
        with tarfile.open(fileobj=source, mode="r|*") as src, \
                tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as dst:
            for member in src:
                data = src.extractfile(member) if member.isreg() else None
                dst.addfile(_clamp_member(member, epoch), data)
        raw.seek(0)
        diff_id, packed = hashlib.sha256(), hashlib.sha256()
        with tempfile.NamedTemporaryFile(dir=blobs, delete=False) as out:
            with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, filename="", compresslevel=6) as gz:
                while chunk := raw.read(1 << 20):
                    diff_id.update(chunk)
                    gz.write(chunk)
        size = os.path.getsize(out.name)
        with open(out.name, "rb") as f:
            while chunk := f.read(1 << 20):
                packed.update(chunk)
        path = blobs / packed.hexdigest()
        os.replace(out.name, path)
    return Blob(f"sha256:{packed.hexdigest()}", size, path), f"sha256:{diff_id.hexdigest()}"


def normalized_config(config: dict[str, Any], diff_ids: list[str], epoch: int) -> dict[str, Any]:
    """The image config without the build's times and bookkeeping, over the rewritten layers."""
    out = {k: v for k, v in config.items() if k not in _BUILD_ONLY_CONFIG_KEYS}
    out["created"] = _rfc3339(epoch)
    out["history"] = [{**h, "created": _rfc3339(epoch)} for h in config.get("history", [])]
    out["rootfs"] = {"type": "layers", "diff_ids": diff_ids}
    runtime = {k: v for k, v in (config.get("config") or {}).items() if k not in ("Hostname", "Image")}
    out["config"] = runtime
    return out


def from_docker_save(archive: Path, ref: str, blobs: Path, epoch: int) -> Image:
    """The image `ref` of a `docker save` archive (its legacy manifest.json) as normalized OCI blobs."""
    blobs.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        index = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
        entry = next((e for e in index if ref in (e.get("RepoTags") or [])), None)
        if entry is None:
            raise SystemExit(f"{archive} holds no image tagged {ref}")
        layers, diff_ids = [], []
        for name in entry["Layers"]:
            layer, diff_id = _normalized_layer(tar.extractfile(name), blobs, epoch)  # type: ignore[arg-type]
            layers.append(layer)
            diff_ids.append(diff_id)
        config = normalized_config(json.load(tar.extractfile(entry["Config"])), diff_ids, epoch)  # type: ignore[arg-type]
    config_blob = _store(blobs, _canonical(config))
    manifest = {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_blob.digest, "size": config_blob.size},
        "layers": [{"mediaType": OCI_LAYER, "digest": b.digest, "size": b.size} for b in layers],
    }
    platform = {"architecture": config["architecture"], "os": config["os"]}
    return Image(_store(blobs, _canonical(manifest)), platform, blobs)


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, epoch: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.uid, info.gid, info.uname, info.gname = len(data), 0o644, epoch, 0, 0, "", ""
    tar.addfile(info, io.BytesIO(data))


def write_oci_archive(image: Image, name: str, out: Path, epoch: int) -> None:
    """An OCI image layout in one tar, named `name` and repo@digest for containerd (`ctr import`,
    `kind load image-archive`, `minikube image load`, `k3d image import`) and `name` for `docker load`
    (manifest.json)."""
    manifest = json.loads(image.manifest.path.read_bytes())
    digests = [manifest["config"]["digest"]] + [layer["digest"] for layer in manifest["layers"]]
    tag = name.rpartition(":")[2]
    descriptor = {"mediaType": OCI_MANIFEST, "digest": image.manifest.digest, "size": image.manifest.size,
                  "platform": image.platform}
    # Also named by its digest: containerd finds a pinned reference (repo:tag@digest, as the packaged
    # chart has it) only under repo@digest, a name a pull creates and an import only when told.
    by_digest = f"{name.rpartition(':')[0]}@{image.manifest.digest}"
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [
        {**descriptor, "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag}},
        {**descriptor, "annotations": {"io.containerd.image.name": by_digest}}]}
    docker = [{"Config": f"blobs/sha256/{digests[0][7:]}", "RepoTags": [name],
               "Layers": [f"blobs/sha256/{d[7:]}" for d in digests[1:]]}]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        _add_bytes(tar, "oci-layout", _canonical({"imageLayoutVersion": "1.0.0"}), epoch)
        _add_bytes(tar, "index.json", _canonical(index), epoch)
        _add_bytes(tar, "manifest.json", _canonical(docker), epoch)
        for digest in [image.manifest.digest, *digests]:
            path = image.blobs / digest[7:]
            info = tar.gettarinfo(str(path), arcname=f"blobs/sha256/{digest[7:]}")
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = epoch, 0, 0, "", "", 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)


def repack_reproducibly(tgz: Path, epoch: int) -> None:
    """`helm package` stamps every entry with the time of packaging: the same entries, in the same
    order, with the epoch's time and no gzip timestamp."""
    raw = io.BytesIO()
    with tarfile.open(tgz) as src, tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for member in src:
            data = src.extractfile(member) if member.isreg() else None
            member.mtime = epoch
            member.pax_headers = {}
            dst.addfile(member, data)
    with tgz.open("wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as gz:
        gz.write(raw.getvalue())


def package_chart(helm: str, digest: str, out: Path, epoch: int) -> Path:
    """The chart with its operator image pinned: the release's tag and the image's digest."""
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / "tether"
        shutil.copytree(ROOT / "charts" / "tether", chart)
        values = chart / "values.yaml"
        text = values.read_text()
        pinned = text.replace('  tag: ""\n', f'  tag: "{version()}"\n', 1).replace('  digest: ""\n', f'  digest: "{digest}"\n', 1)
        if pinned.count(digest) != 1 or f'tag: "{version()}"' not in pinned:
            raise SystemExit("charts/tether/values.yaml no longer has image.tag and image.digest as release.py expects")
        values.write_text(pinned)
        subprocess.run([helm, "package", str(chart), "--destination", str(out)], check=True, stdout=subprocess.DEVNULL)
    tgz = out / f"tether-{version()}.tgz"
    repack_reproducibly(tgz, epoch)
    return tgz


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _script(name: str) -> Path:
    out = subprocess.run(["bash", str(ROOT / "hack" / name)], cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def build_images(out: Path, epoch: int, cache: Path) -> dict[str, str]:
    """The operator and example-worker images as OCI archives; {reference: digest}. Cached by the
    image build and the epoch: converting 400 MB takes a minute, and make test does it each time."""
    images_dir = _script("build-images.sh")
    env = dict(line.split("=", 1) for line in (images_dir / "images.env").read_text().splitlines() if "=" in line)
    key = cache / f"{images_dir.name}_{epoch}_{version()}"
    if not (key / ".complete").exists():
        shutil.rmtree(key, ignore_errors=True)
        image = from_docker_save(images_dir / "tether.tar", env["TETHER_IMAGE"], key / "blobs", epoch)
        for repo in ("tether", "example-worker"):
            write_oci_archive(image, f"{REGISTRY}/{repo}:{version()}", key / f"{repo}-{version()}.oci.tar", epoch)
        (key / "digest").write_text(image.manifest.digest)
        shutil.rmtree(key / "blobs")
        (key / ".complete").touch()
        for old in cache.iterdir():  # one conversion kept: each is about 300 MB
            if old != key:
                shutil.rmtree(old, ignore_errors=True)
    digest = (key / "digest").read_text()
    (out / "images").mkdir(parents=True, exist_ok=True)
    refs = {}
    for repo in ("tether", "example-worker"):
        name = f"{repo}-{version()}.oci.tar"
        target = out / "images" / name
        target.unlink(missing_ok=True)
        try:  # a hard link when the cache is on dist's file system: no second 150 MB copy
            os.link(key / name, target)
        except OSError:
            shutil.copy(key / name, target)
        refs[f"{REGISTRY}/{repo}:{version()}"] = digest
    return refs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "dist")
    parser.add_argument("--helm", default=None, help="helm to package the chart with (default: the one hack/build-tools.sh builds)")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    epoch = source_date_epoch()
    cache = Path(os.environ.get("TETHER_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tether") / "release"
    cache.mkdir(parents=True, exist_ok=True)
    refs = build_images(out, epoch, cache)
    helm = args.helm or str(_script("build-tools.sh") / "helm")
    package_chart(helm, refs[f"{REGISTRY}/tether:{version()}"], out, epoch)
    subprocess.run([sys.executable, str(HERE / "kubectl-tether" / "build.py"), "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    (out / "images.txt").write_text("".join(f"{ref}@{digest}\n" for ref, digest in sorted(refs.items())))
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    (out / "SHA256SUMS").write_text("".join(f"{_sha256(p)}  {p.relative_to(out)}\n" for p in files))
    print((out / "SHA256SUMS").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
