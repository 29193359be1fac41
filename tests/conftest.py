"""Test plumbing: one shared control plane per test run, one namespace per test.

The controlling pytest process (the xdist controller, or the only process)
starts the local control plane in pytest_configure and hands its kubeconfig
to the workers through the environment. TETHER_TEST_KUBECONFIG points the
suite at any other cluster instead (for example kind). Tests under
tests/unit are marked `unit` and need no cluster: `pytest -m unit`.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from testkit.kube import Kube, eventually

if False:  # typing only
    from testkit.operator_process import OperatorProcess  # noqa: F401
    from tests.support.realnode import RealNodeHandle  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
_cluster = None


def _wants_cluster(config: pytest.Config) -> bool:
    if (config.getoption("markexpr") or "").strip() == "unit":
        return False
    args = [a for a in config.args if not a.startswith("-")]
    # tests/unit need no cluster; tests/kind bring a kind cluster of their own.
    return not args or any(not {"unit", "kind"} & set(Path(a).parts) for a in args)


def _runs_tests_under(config: pytest.Config, folder: str, env: str) -> bool:
    """Whether the whole suite (`tests`, or no argument), tests/<folder> or a file in it runs;
    the environment variable `env` (1 or 0) decides instead when set."""
    explicit = os.environ.get(env)
    if explicit is not None:
        return explicit == "1"
    under = ROOT / "tests" / folder
    paths = [Path(a.split("::")[0]).resolve() for a in config.args if not a.startswith("-")]
    return not paths or any(under.is_relative_to(p) or p.is_relative_to(under) for p in paths)


def pytest_configure(config: pytest.Config) -> None:
    global _cluster
    if hasattr(config, "workerinput") or os.environ.get("TETHER_TEST_KUBECONFIG"):
        return
    if not _wants_cluster(config) or config.option.collectonly:
        return
    from tether.devcluster.controlplane import LocalCluster, resolve_binaries
    from tether.devcluster.crds import install_crds, install_policies

    # TETHER_TEST_KUBERNETES=oldest: the oldest supported API server (make test runs the tests of
    # admission, approvals, fencing and queueing again on it).
    bin_dir = resolve_binaries(oldest=os.environ.get("TETHER_TEST_KUBERNETES") == "oldest")
    # The audit log is the fault trials' independent oracle; it costs one JSON line per write.
    # Two kwok nodes (tainted: only pods that ask land there) keep the scale harness from rotting.
    # The real node (kubelet + containerd, tests/node) and Kueue (tests/kueue) when the whole suite or their tests run.
    _cluster = LocalCluster(bin_dir=bin_dir, keep_state=bool(os.environ.get("TETHER_KEEP_CLUSTER")), audit=True, lean=True,
                            kwok_nodes=2, real_node=_runs_tests_under(config, "node", "TETHER_REAL_NODE"),
                            with_kueue=_runs_tests_under(config, "kueue", "TETHER_KUEUE_TESTS"))
    _cluster.__enter__()
    with _cluster.client() as client:
        install_crds(client)
        # Every test runs with fencing enforced by the API server, as a chart install has it.
        install_policies(client)
    os.environ["TETHER_TEST_KUBECONFIG"] = str(_cluster.kubeconfig)
    os.environ["TETHER_TEST_AUDIT_LOG"] = str(_cluster.audit_log)
    os.environ["TETHER_TEST_BIN_DIR"] = str(bin_dir)
    os.environ["TETHER_TEST_STATE_DIR"] = str(_cluster.state_dir)
    if _cluster.node is not None:
        os.environ["TETHER_TEST_REAL_NODE"] = json.dumps(_cluster.node.describe())
    if _cluster.kueue is not None:
        os.environ["TETHER_TEST_KUEUE"] = json.dumps(_cluster.kueue.describe())
    config.stash[_startup_key] = _cluster.startup_seconds


_startup_key = pytest.StashKey[float]()


def pytest_report_header(config: pytest.Config) -> str | None:
    if _startup_key in config.stash:
        return f"tether: local control plane at {_cluster.server} started in {config.stash[_startup_key]:.1f}s"  # type: ignore[union-attr]
    return None


def pytest_unconfigure(config: pytest.Config) -> None:
    global _cluster
    if _cluster is not None:
        _cluster.__exit__(None, None, None)
        _cluster = None


# The longest work first (a worker's xdist group runs one test after another; the rest take
# minutes each: a kind cluster, the scale smoke run, a namesake's token dying, private control
# planes): xdist hands out work in collection order, and a long test handed out last is the run's tail.
LONGEST_FIRST = ("tests/kind/", "tests/kueue/", "tests/e2e/test_scale_smoke.py", "tests/e2e/test_chaos.py",
                 "tests/e2e/test_review_findings.py::test_a_namesakes_pod_stuck_terminating",
                 "tests/e2e/test_quickstart.py", "tests/e2e/test_outage.py", "tests/e2e/test_dev_cluster_kueue.py",
                 "tests/node/", "tests/e2e/test_ship.py", "tests/e2e/test_agent_loop.py", "tests/e2e/test_safety.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "unit" in Path(str(item.fspath)).relative_to(ROOT).parts:
            item.add_marker(pytest.mark.unit)
        else:
            item.add_marker(pytest.mark.cluster)

    def rank(item: pytest.Item) -> int:
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
                    len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: within a rank, as collected


def pytest_runtest_setup(item: pytest.Item) -> None:
    """xdist keeps a group on one worker by a suffix it writes into each node id, which some pytest
    releases silently drop (pytest-xdist#1386): the tests sharing one Kueue then ran side by side."""
    if hasattr(item.config, "workerinput") and item.config.getvalue("loadgroup") \
            and item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
        pytest.fail(f"--dist loadgroup does not keep this test's group on one worker with pytest "
                    f"{pytest.__version__} (pytest-xdist#1386): install the versions pyproject.toml allows",
                    pytrace=False)


@pytest.fixture(scope="session")
def kube() -> Kube:
    path = os.environ.get("TETHER_TEST_KUBECONFIG")
    if not path:
        pytest.fail("no cluster: run the suite through `make test`, or set TETHER_TEST_KUBECONFIG")
    return Kube(path)


@pytest.fixture(scope="session")
def bin_dir() -> Path:
    """Where kubectl and the control-plane binaries are."""
    return Path(os.environ["TETHER_TEST_BIN_DIR"])


@pytest.fixture(scope="session")
def tools_dir() -> Path:
    """helm and the kstatus checker, built from Go modules (cached) by hack/build-tools.sh."""
    import subprocess

    out = subprocess.run(["bash", str(ROOT / "hack" / "build-tools.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def real_node() -> "RealNodeHandle":
    """The cluster's real node (kubelet + containerd + runc); see tests/support/realnode.py."""
    from tests.support.realnode import RealNodeHandle

    described = os.environ.get("TETHER_TEST_REAL_NODE")
    if not described:
        pytest.fail("no real node: run tests/node through `make test` (or with TETHER_REAL_NODE=1)")
    return RealNodeHandle.from_description(json.loads(described))


@pytest.fixture(scope="session")
def kueue() -> dict[str, str]:
    """Kueue's manager on the test cluster (tether.devcluster.kueue): its log and pid."""
    described = os.environ.get("TETHER_TEST_KUEUE")
    if not described:
        pytest.fail("no Kueue: run tests/kueue through `make test` (or with TETHER_KUEUE_TESTS=1)")
    return dict(json.loads(described))


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, with its default service account ready. Its name comes from the
    test's, unless the test names one (`@pytest.mark.parametrize("namespace", [...], indirect=True)`:
    the console's screenshots show a user's namespace, not a test's)."""
    name = getattr(request, "param", None)
    if name:
        # It may still be going away after an earlier run on the same cluster (make e2e-kind).
        eventually(lambda: kube.get(f"/api/v1/namespaces/{name}").status_code == 404, timeout=120,
                   what=f"no namespace {name} left")
    else:
        stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
        name = f"t-{stem}-{uuid.uuid4().hex[:5]}"
    kube.ok(kube.post("/api/v1/namespaces", {"metadata": {"name": name, "labels": {"tether.dev/test": "true"}}}))
    eventually(lambda: kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default").status_code == 200,
               timeout=60, what=f"default service account in {name}")
    yield name
    kube.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture
def operator(namespace: str, tmp_path: Path) -> Iterator["OperatorProcess"]:
    """`tether operator` watching only this test's namespace, as a killable subprocess.

    With TETHER_TEST_EXTERNAL_OPERATOR (make e2e-kind) the chart's operator in the cluster
    does the work instead; tests that need this process are marked local_cluster."""
    from testkit.operator_process import OperatorProcess

    if os.environ.get("TETHER_TEST_EXTERNAL_OPERATOR"):
        yield None  # type: ignore[misc]
        return

    # Fold heartbeat-borne usage into status every second (default 10 s), and boost a queued
    # run's priority from 1 s of unsaved work (default 60 s), so tests run fast.
    proc = OperatorProcess(namespace, os.environ["TETHER_TEST_KUBECONFIG"], tmp_path / "operator.log",
                           extra_env={"TETHER_FOLD_INTERVAL_SECONDS": "1", "TETHER_KUEUE_BOOST_SECONDS": "1"}).start()
    yield proc
    proc.stop()
    # Shown by pytest only when the test failed.
    print("--- operator log (tail) ---")
    print("\n".join(proc.log_path.read_text(errors="replace").splitlines()[-60:]))


def pod_log(namespace: str, pod: str) -> str:
    """The container log of a pod run by the process kubelet (local cluster only)."""
    state = Path(os.environ.get("TETHER_TEST_STATE_DIR", "/nonexistent")) / "pods"
    logs = sorted(state.glob(f"{namespace}_{pod}_*/container.log"))
    return "\n".join(p.read_text(errors="replace") for p in logs)
