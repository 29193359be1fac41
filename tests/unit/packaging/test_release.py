"""`make release` (packaging/release.py): the same content gives the same bytes and digests, whatever
time the build ran at, and the archives are what containerd, Docker and Helm read. The whole path —
the archives loaded into kind, the packaged chart installed, its pinned digest running — is
tests/kind (docs/own-cluster.md's block)."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("release", ROOT / "packaging" / "release.py")
release = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["release"] = release  # (dataclasses look their module up)
_spec.loader.exec_module(release)  # type: ignore[union-attr]
EPOCH = 1_700_000_000


def _tar(entries: list[tuple[str, bytes, int]]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mtime in entries:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), mtime
            info.pax_headers = {"atime": str(mtime + 0.5), "ctime": str(mtime + 0.25)}
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def docker_save(path: Path, layers: list[bytes], built_at: str, container: str, tag: str = "tether.local/tether:x") -> Path:
    """A `docker save` archive as Docker 20.10 writes it (legacy manifest.json)."""
    config = {"architecture": "amd64", "os": "linux", "created": built_at, "container": container,
              "container_config": {"Hostname": container}, "docker_version": "20.10.24",
              "config": {"Hostname": container, "Image": "sha256:" + container, "Entrypoint": ["tether"]},
              "history": [{"created": built_at, "created_by": "COPY ..."} for _ in layers],
              "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(b).hexdigest()}" for b in layers]}}
    entries = [(f"l{i}/layer.tar", data, 0) for i, data in enumerate(layers)]
    entries.append(("config.json", json.dumps(config).encode(), 0))
    entries.append(("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": [tag, "other:1"],
                                                  "Layers": [f"l{i}/layer.tar" for i in range(len(layers))]}]).encode(), 0))
    path.write_bytes(_tar(entries))
    return path


def _build(tmp: Path, name: str, mtime: int, built_at: str, container: str, content: bytes = b"print(1)\n") -> Path:
    layers = [_tar([("etc/passwd", b"root:x:0:0\n", mtime)]), _tar([("opt/tether/bin/tether", content, mtime + 7)])]
    saved = docker_save(tmp / f"{name}.tar", layers, built_at, container)
    image = release.from_docker_save(saved, "tether.local/tether:x", tmp / name / "blobs", EPOCH)
    out = tmp / name / "tether.oci.tar"
    release.write_oci_archive(image, "ghcr.io/tether-dev/tether:0.1.0", out, EPOCH)
    return out


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]


def test_two_builds_of_the_same_content_at_other_times_give_the_same_bytes(tmp_path: Path) -> None:
    first = _build(tmp_path, "a", 1_800_000_000, "2026-12-06T10:00:00Z", "c0ffee")
    second = _build(tmp_path, "b", 1_800_003_600, "2026-12-06T11:00:00Z", "beef00")
    assert first.read_bytes() == second.read_bytes()
    other = _build(tmp_path, "c", 1_800_000_000, "2026-12-06T10:00:00Z", "c0ffee", content=b"print(2)\n")
    assert json.loads(_members(other)["index.json"]) != json.loads(_members(first)["index.json"])


def _manifest(files: dict[str, bytes]) -> tuple[dict[str, Any], dict[str, Any]]:
    entry, by_digest = json.loads(files["index.json"])["manifests"]
    assert {k: v for k, v in by_digest.items() if k != "annotations"} == {k: v for k, v in entry.items() if k != "annotations"}
    assert by_digest["annotations"] == {"io.containerd.image.name": f"ghcr.io/tether-dev/tether@{entry['digest']}"}
    return entry, json.loads(files[f"blobs/sha256/{entry['digest'][7:]}"])


def test_the_archive_is_an_oci_layout_named_for_containerd_and_docker(tmp_path: Path) -> None:
    files = _members(_build(tmp_path, "a", 1_800_000_000, "2026-12-06T10:00:00Z", "c0ffee"))
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    entry, manifest = _manifest(files)
    assert entry["annotations"] == {"io.containerd.image.name": "ghcr.io/tether-dev/tether:0.1.0",
                                    "org.opencontainers.image.ref.name": "0.1.0"}
    assert entry["platform"] == {"architecture": "amd64", "os": "linux"}
    for name, data in files.items():  # every blob is named by its content's digest
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    config = json.loads(files[f"blobs/sha256/{manifest['config']['digest'][7:]}"])
    assert config["created"] == "2023-11-14T22:13:20Z" and {h["created"] for h in config["history"]} == {config["created"]}
    assert not {"container", "container_config", "docker_version"} & set(config)
    assert config["config"] == {"Entrypoint": ["tether"]}
    (docker,) = json.loads(files["manifest.json"])
    assert docker["RepoTags"] == ["ghcr.io/tether-dev/tether:0.1.0"]
    assert docker["Config"] == f"blobs/sha256/{manifest['config']['digest'][7:]}"
    for layer, diff_id, path in zip(manifest["layers"], config["rootfs"]["diff_ids"], docker["Layers"]):
        assert path == f"blobs/sha256/{layer['digest'][7:]}"
        unpacked = gzip.decompress(files[path])
        assert hashlib.sha256(unpacked).hexdigest() == diff_id[7:]
        with tarfile.open(fileobj=io.BytesIO(unpacked)) as tar:
            for member in tar:  # times clamped to the epoch (none later), no atime/ctime left
                assert member.mtime == EPOCH and not {"atime", "ctime"} & set(member.pax_headers)


def test_a_file_older_than_the_epoch_gets_the_epoch_too(tmp_path: Path) -> None:
    """A checkout's files carry the times of that clone: two clones of one commit must give one image."""
    layer = _tar([("old", b"x", 1_000)])
    saved = docker_save(tmp_path / "s.tar", [layer], "2026-01-01T00:00:00Z", "c")
    image = release.from_docker_save(saved, "tether.local/tether:x", tmp_path / "blobs", EPOCH)
    manifest = json.loads(image.manifest.path.read_bytes())
    blob = (tmp_path / "blobs" / manifest["layers"][0]["digest"][7:]).read_bytes()
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob))) as tar:
        assert [m.mtime for m in tar] == [EPOCH]


def test_an_archive_without_the_image_says_so(tmp_path: Path) -> None:
    saved = docker_save(tmp_path / "s.tar", [_tar([("a", b"a", 1)])], "2026-01-01T00:00:00Z", "c", tag="else:1")
    with pytest.raises(SystemExit, match="no image tagged tether.local/tether:x"):
        release.from_docker_save(saved, "tether.local/tether:x", tmp_path / "blobs", EPOCH)


def test_the_chart_is_packaged_with_its_image_pinned_and_the_same_bytes_each_time(tmp_path: Path, tools_dir: Path) -> None:
    digest = "sha256:" + "ab" * 32
    first = release.package_chart(str(tools_dir / "helm"), digest, tmp_path / "a", EPOCH)
    second = release.package_chart(str(tools_dir / "helm"), digest, tmp_path / "b", EPOCH)
    assert first.read_bytes() == second.read_bytes()
    rendered = subprocess.run([str(tools_dir / "helm"), "template", "tether", str(first), "--kube-version", "1.36.0"],
                              check=True, stdout=subprocess.PIPE, text=True).stdout
    version = release.version()
    assert f"image: \"ghcr.io/tether-dev/tether:{version}@{digest}\"" in rendered
    with tarfile.open(first) as tar:
        assert {m.mtime for m in tar} == {EPOCH}
