"""Tether at the scale users run it (`make bench`), on a local control plane with kwok nodes.

    .venv/bin/python benchmarks/scale.py                       # every scenario, full size
    .venv/bin/python benchmarks/scale.py --smoke               # a few dozen runs, under a minute
    .venv/bin/python benchmarks/scale.py --scenarios launch,steady --runs 2000

Scenarios (each in its own namespace, with its own operator process):
  launch   N pod-backed WorkerRuns and N batch Jobs on the same API server, created at 20/s and at
           full speed, alternating which goes first: create -> pod created and create -> Running
           (kwok marks pods Running), p50/p99, and throughput.
  steady   N live runs played by the simulated fleet (benchmarks/fleet.py) at L=90 s/renew 30 s and
           at L=30 s/renew 10 s: the operator's CPU and RSS, API requests per heartbeat from the
           API server's own /metrics, the operator's watch lag. During it, `--lapses` sampled
           workers freeze at random moments: last renewal -> attempt marked LeaseLost, and false
           LeaseLost over the whole run.
  restart  kill -9 of the operator under N live runs: time until it knows every run again, its
           request burst (its own rest_client_requests_total, 1 s buckets), false LeaseLost.
  burst    N External runs created at once: create -> granted, until the last is granted, and the
           API writes and operator CPU per grant.
  budget   N runs charging one WorkerBudget: charges, conflicts, the budget's size.
  ceiling  more live runs, step by step, until a goal breaks.

Writes benchmarks/results/<date>.json (and .png figures with --figures) and prints a summary;
`benchmarks/report.py` turns the JSON into the README's table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import percentile  # noqa: E402
from benchmarks.fleet import FleetProcess, Plan, Played  # noqa: E402
from tether.devcluster.controlplane import LocalCluster, kwok_placement, resolve_binaries  # noqa: E402
from tether.devcluster.crds import install_crds, install_policies  # noqa: E402
from tether.devcluster.processes import free_port, spawn, terminate, wait_for  # noqa: E402
from tether.kube import config as kubeconfig  # noqa: E402

WR = "/apis/tether.dev/v1alpha1/namespaces/{ns}/workerruns"
PODS = "/api/v1/namespaces/{ns}/pods"
JOBS = "/apis/batch/v1/namespaces/{ns}/jobs"
# Phases a pod reaches only after Running (kwok completes Job pods at once).
RAN = ("Running", "Succeeded", "Failed")
# kube-controller-manager's defaults (--kube-api-qps 20, --kube-api-burst 30): the Job controller
# runs with them here. Tether's are its own defaults unless --qps/--burst say otherwise.
KCM_QPS, KCM_BURST = 20, 30


# --- the environment ---------------------------------------------------------------------------


@dataclass
class Env:
    kubeconfig: Path
    api: httpx.Client
    cfg: kubeconfig.KubeConfig
    qps: float
    burst: int
    prefix: str = ""  # of every namespace made here (a shared test cluster)
    # Another checkout whose operator runs instead of this one's (old and new code side by side).
    operator_source: Path | None = None

    def namespace(self, name: str) -> str:
        name = f"{self.prefix}{name}"
        self.api.post("/api/v1/namespaces", json={"metadata": {"name": name}}).raise_for_status()
        wait_for(lambda: self.api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default").status_code == 200,
                 timeout=60, what=f"namespace {name}")
        return name

    def apiserver_requests(self) -> Counter[tuple[str, str]]:
        """apiserver_request_total summed by (resource[/subresource], verb): the API server's own count."""
        out: Counter[tuple[str, str]] = Counter()
        for line in self.api.get("/metrics").text.splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line[:line.rindex("}")]))
            resource = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
            out[(resource, labels.get("verb", ""))] += int(float(line.rsplit(" ", 1)[1]))
        return out


@contextlib.contextmanager
def environment(kwok_nodes: int, qps: float, burst: int, kueue: bool = False,
                operator_source: Path | None = None) -> Iterator[Env]:
    with LocalCluster(bin_dir=resolve_binaries(), with_kubelet=False, kwok_nodes=kwok_nodes,
                      with_kueue=kueue) as cluster:
        api = cluster.client(timeout=60)
        install_crds(api)
        install_policies(api)
        yield Env(cluster.kubeconfig, api, kubeconfig.load(str(cluster.kubeconfig)), qps, burst,
                  operator_source=operator_source)


def existing(path: Path, qps: float, burst: int, prefix: str) -> Env:
    """A cluster that is already up (with kwok nodes, the CRDs and the policies installed)."""
    cfg = kubeconfig.load(str(path))
    return Env(path, cfg.sync_client(timeout=60), cfg, qps, burst, prefix)


class Operator:
    """The operator as a process of its own, watched from outside (CPU, RSS, its /metrics)."""

    def __init__(self, env: Env, ns: str) -> None:
        self.env, self.ns = env, ns
        self.port = free_port()
        self.log = Path(tempfile.mkdtemp(prefix="tether-bench-")) / "operator.log"
        self.proc: Any = None
        self.start()

    def start(self) -> None:
        args = [sys.executable, "-m", "tether.cli", "operator", "-n", self.ns, f"--metrics-port={self.port}",
                f"--kube-qps={self.env.qps}", f"--kube-burst={self.env.burst}"]
        env = {**os.environ, "KUBECONFIG": str(self.env.kubeconfig)}
        if self.env.operator_source is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(self.env.operator_source / "operator"),
                                                 *filter(None, [os.environ.get("PYTHONPATH")])])
        self.proc = spawn(args, log_path=self.log, env=env)
        self.ps = psutil.Process(self.proc.pid)
        wait_for(lambda: self._metrics_up(), timeout=60, what="operator /metrics")

    def _metrics_up(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self, names: list[str] | None = None) -> dict[str, float]:
        """Every sample of the operator's /metrics, keyed by its full name with labels; with
        `names`, only those families (a frequent probe must not cost the operator 5,000 series)."""
        out: dict[str, float] = {}
        for _ in range(5):  # a failed scrape (an answer that is not 200) is tried again, as Prometheus would
            resp = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=10,
                             params={"name[]": names} if names else None)
            if resp.status_code == 200:
                break
            time.sleep(1)
        for line in resp.raise_for_status().text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def cpu_seconds(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def rss_mib(self) -> float:
        return float(self.ps.memory_info().rss / 2**20)

    def profile(self, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
        """Starts py-spy sampling the operator for `seconds` (collapsed stacks into `out`); None
        when py-spy cannot attach here."""
        spy = Path(sys.executable).with_name("py-spy")
        if not spy.exists():
            return None
        return subprocess.Popen([str(spy), "record", "--pid", str(self.proc.pid), "--duration", str(int(seconds)),
                                 "--rate", "50", "--nonblocking", "--format", "raw", "--output", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        terminate(self.proc)


def profile_summary(collapsed: Path, top: int = 10) -> dict[str, Any]:
    """The functions the operator spent its samples in (py-spy's collapsed stacks): by own time
    (the innermost frame) and by module, as shares of all samples."""
    own: Counter[str] = Counter()
    modules: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        total += n
        own[_frame(frames[-1])] += n
        # The innermost frame in Tether's own code, else the innermost library's package.
        mine = next((f for f in reversed(frames) if "/tether/" in f), None)
        modules[_module(mine or frames[-1])] += n
    share = lambda c: {k: round(v / max(total, 1), 3) for k, v in c.most_common(top)}  # noqa: E731
    return {"samples": total, "ownTime": share(own), "byModule": share(modules)}


def _frame(frame: str) -> str:
    """`func (path/to/file.py:12)` -> `file.py:func`."""
    m = re.match(r"(.*?) \((.*?)(?::\d+)?\)$", frame)
    return f"{Path(m.group(2)).name}:{m.group(1)}" if m else frame


def _module(frame: str) -> str:
    m = re.match(r".*? \((.*?)(?::\d+)?\)$", frame)
    if not m:
        return frame
    path = m.group(1)
    if "/tether/" in path:
        return "tether/" + path.split("/tether/", 1)[1].rsplit(".", 1)[0]
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0]
    return Path(path).parent.name + "/" + Path(path).stem  # the standard library


def requests_sent(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("rest_client_requests_total{"))


def _by_method(metrics: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if k.startswith("rest_client_requests_total{") and (m := re.search(r'method="(\w+)"', k)):
            out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


def histogram_quantile(metrics: dict[str, float], name: str, q: float) -> float | None:
    """Prometheus' histogram_quantile over one unlabelled histogram (linear within a bucket)."""
    buckets = sorted((float(m.group(1)), v) for k, v in metrics.items()
                     if (m := re.fullmatch(rf'{name}_bucket\{{le="([^"]+)"\}}', k)))
    if not buckets or buckets[-1][1] == 0:
        return None
    rank, prev_le, prev_n = q * buckets[-1][1], 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / max(n - prev_n, 1e-9))
        prev_le, prev_n = le, n
    return prev_le


def create_paced(env: Env, path: str, bodies: list[dict[str, Any]], rate: float | None) -> dict[str, float]:
    """POSTs the bodies, at `rate` per second (None: as fast as 16 connections go). Returns each
    object's name -> wall-clock time its create was sent."""
    sent: dict[str, float] = {}
    began = time.monotonic()

    def one(i_body: tuple[int, dict[str, Any]]) -> None:
        i, body = i_body
        if rate:
            delay = began + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing: the schedule is the point, not a condition
        sent[body["metadata"]["name"]] = time.time()
        for _ in range(5):
            resp = env.api.post(path, json=body)
            if resp.status_code != 429:
                resp.raise_for_status()
                return
            time.sleep(1)
        resp.raise_for_status()

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, enumerate(bodies)))
    return sent


# How long the pod watcher's read may block before it looks at its stop flag.
STOP_POLL_SECONDS = 1.0


class Times:
    """Watches a collection; records when each object first showed each mark `marks(obj)` names,
    by key (wall clock, this process). Lists again after a broken stream."""

    def __init__(self, env: Env, path: str, marks: Callable[[dict[str, Any]], list[tuple[str, str]]]) -> None:
        self.first: dict[str, dict[str, float]] = {}  # mark -> key -> time
        self.restarts: list[str] = []
        self._marks = marks
        self._stop = threading.Event()
        # A short read timeout, so the watcher sees stop() itself: closing the client under a
        # blocked read (as this once did) freed the socket's fd while the thread still read it, and
        # the next socket given that number (the fleet's pipe) had its bytes stolen: the fleet's
        # answers then arrived misaligned and the smoke test hung.
        self._http = httpx.Client(base_url=env.cfg.server, verify=env.cfg.ssl_context, auth=env.cfg.auth(),
                                  timeout=httpx.Timeout(10, read=STOP_POLL_SECONDS))
        self._thread = threading.Thread(target=self._watch, args=(path,), daemon=True)
        self._thread.start()

    def of(self, mark: str) -> dict[str, float]:
        return self.first.setdefault(mark, {})

    def _see(self, obj: dict[str, Any], now: float) -> None:
        for mark, key in self._marks(obj):
            self.of(mark).setdefault(key, now)

    def _watch(self, path: str) -> None:
        while not self._stop.is_set():
            try:
                self._follow(path)
            except Exception as exc:  # noqa: BLE001 - closing the client under a read raises anything
                if self._stop.is_set():
                    return
                self.restarts.append(repr(exc))  # a broken stream: list and watch again
                time.sleep(0.5)  # a pause before the next list, not a condition

    def _follow(self, path: str) -> None:
        listed = self._http.get(path, timeout=30).raise_for_status().json()
        rv, now = listed["metadata"]["resourceVersion"], time.time()
        for obj in listed["items"]:  # after a broken stream: what happened meanwhile, seen now
            self._see(obj, now)
        while not self._stop.is_set():
            try:
                with self._http.stream("GET", path, params={"watch": "1", "resourceVersion": rv,
                                                            "timeoutSeconds": "60"}) as resp:
                    for line in resp.iter_lines():
                        if self._stop.is_set():
                            return
                        if not line:
                            continue
                        event = json.loads(line)
                        obj = event["object"]
                        rv = obj["metadata"].get("resourceVersion", rv)
                        if event["type"] != "DELETED":
                            self._see(obj, time.time())
            except httpx.ReadTimeout:
                continue  # quiet for a second: look at the stop flag, then watch on from rv

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3 * STOP_POLL_SECONDS + 10)  # it sees the flag within a read timeout
        self._http.close()  # only once nothing reads from it


class PodTimes(Times):
    """A namespace's pods: when each owner's first pod was first seen, and first seen Running."""

    def __init__(self, env: Env, ns: str, owner_label: str) -> None:
        def marks(pod: dict[str, Any]) -> list[tuple[str, str]]:
            owner = (pod["metadata"].get("labels") or {}).get(owner_label)
            if owner is None:
                return []
            return [("created", owner)] + ([("running", owner)] if (pod.get("status") or {}).get("phase") in RAN
                                           else [])

        super().__init__(env, PODS.format(ns=ns), marks)
        self.created, self.running = self.of("created"), self.of("running")


def summary(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(percentile(values, 50), 3), "p99": round(percentile(values, 99), 3),
            "max": round(max(values), 3)}


# --- the objects -----------------------------------------------------------------------------


def worker_run(name: str, duration: int, renew: int, grace: int | None = None) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name},
            "spec": {"template": {"spec": {"containers": [{"name": "worker", "image": "tether-bench/worker",
                                                           "command": ["worker"]}], **kwok_placement()}},
                     "lease": {"durationSeconds": duration, "renewIntervalSeconds": renew,
                               "startupGraceSeconds": grace if grace is not None else duration},
                     "retry": {"maxAttempts": 3, "backoff": {"initialSeconds": 1}}}}


def external_run(name: str, duration: int = 3600, renew: int = 600) -> dict[str, Any]:
    """An External run: granted to whoever claims it through the gateway (nobody here): no pod."""
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name},
            "spec": {"executor": "External", "lease": {"durationSeconds": duration, "renewIntervalSeconds": renew,
                                                       "startupGraceSeconds": duration}}}


def batch_job(name: str) -> dict[str, Any]:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "containers": [{"name": "c", "image": "tether-bench/job", "command": ["c"]}],
                **kwok_placement()}}}}


# --- scenarios -------------------------------------------------------------------------------


def launch(env: Env, n: int, rate: float | None, first: str) -> dict[str, Any]:
    """N WorkerRuns and N Jobs, one after the other (`first` goes first), at `rate` per second."""
    tag = f"{int(rate)}ps" if rate else "full"
    out: dict[str, Any] = {"runs": n, "ratePerSecond": rate, "first": first}
    for kind in ([first, "jobs" if first == "tether" else "tether"]):
        ns = env.namespace(f"launch-{kind}-{tag}")
        if kind == "tether":
            op = Operator(env, ns)
            watch = PodTimes(env, ns, "tether.dev/run")
            sent = create_paced(env, WR.format(ns=ns), [worker_run(f"r{i}", 3600, 600) for i in range(n)], rate)
        else:
            op = None
            watch = PodTimes(env, ns, "batch.kubernetes.io/job-name")
            sent = create_paced(env, JOBS.format(ns=ns), [batch_job(f"j{i}") for i in range(n)], rate)
        try:
            wait_for(lambda w=watch: len(w.running) >= n, timeout=max(600, n), interval=0.5,
                     what=f"{n} {kind} pods Running")
        finally:
            watch.stop()
            cpu = op.cpu_seconds() if op else None
            by_method = _by_method(op.metrics()) if op else {}
            if op:
                op.stop()
        to_pod = [watch.created[k] - sent[k] for k in sent]
        to_running = [watch.running[k] - sent[k] for k in sent]
        first_sent, last_pod = min(sent.values()), max(watch.created.values())
        out[kind] = {"createToPod": summary(to_pod), "createToRunning": summary(to_running),
                     "podsPerSecond": round(n / max(last_pod - first_sent, 1e-3), 1),
                     "watchRestarts": len(watch.restarts),
                     **({"operatorCpuSeconds": round(cpu, 1),
                         "operatorRequestsPerLaunch": {m: round(c / n, 2) for m, c in by_method.items()}}
                        if cpu is not None else {})}
        print(f"  launch {kind} {tag}: {out[kind]}", flush=True)
    return out


class Population:
    """Live runs in one namespace, played by the fleet, under one operator; grows on demand."""

    def __init__(self, env: Env, name: str, duration: int, renew: int, plan: Plan | None = None,
                 budget: str | None = None, ramp_rate: float | None = None) -> None:
        self.env, self.duration, self.renew, self.budget = env, duration, renew, budget
        # Runs created per second while growing (None: as fast as they go). A ramp is not what is
        # measured: paced, it leaves the two cores to the runs already renewing.
        self.ramp_rate = ramp_rate
        self.ns = env.namespace(name)
        if budget is not None:
            env.api.post(f"/apis/tether.dev/v1alpha1/namespaces/{self.ns}/workerbudgets", json={
                "apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget", "metadata": {"name": budget},
                "spec": {"limitCents": 10**9}}).raise_for_status()
        self.op = Operator(env, self.ns)
        self.fleet = FleetProcess(env.kubeconfig, self.ns, plan or Plan())
        self.n = 0
        self.frozen: set[str] = set()  # runs a lapse sample froze: their LeaseLost is expected

    def grow(self, to: int) -> float:
        """Adds runs r<n>..r<to-1>; returns seconds until all of them renew."""
        began = time.monotonic()
        bodies = [worker_run(f"r{i}", self.duration, self.renew, grace=600) for i in range(self.n, to)]
        for body in bodies:
            if self.budget is not None:
                body["spec"]["budget"] = {"budgetRef": {"name": self.budget}}
        create_paced(self.env, WR.format(ns=self.ns), bodies, self.ramp_rate)
        self.n = to
        wait_for(lambda: self._renewing() >= to, timeout=max(900, to / 2), interval=1,
                 what=f"{to} workers renewing")
        return time.monotonic() - began

    def _renewing(self) -> int:
        return self.fleet.renewing()

    def _running(self) -> float:
        counts = self.op.metrics(["tether_workerruns"])
        return sum(v for k, v in counts.items() if k.startswith("tether_workerruns{") and 'phase="Running"' in k)

    def measure(self, window: float, lapses: int, seed: int, profile: Path | None = None) -> dict[str, Any]:
        """A steady window; `lapses` sampled workers freeze at random moments of it. With `profile`,
        py-spy samples the operator over the window into that file."""
        rng = random.Random(seed)
        live = [f"r{i}" for i in range(self.n) if f"r{i}" not in self.frozen]
        # Early enough in the window for the lapse to be judged before it ends.
        freeze_in = {run: rng.uniform(0, window - self.duration - 2 * self.renew)
                     for run in rng.sample(live, min(lapses, len(live)))}
        # Every run's first renewal is recorded (one status write each, not a heartbeat's cost)
        # before the window opens; then one more renew interval for the ramp's tail to settle.
        wait_for(lambda: self._running() >= self.n, timeout=max(600, self.n / 5), interval=2,
                 what=f"the operator marking all {self.n} runs Running")
        time.sleep(self.renew)  # settling, not a condition
        op, fleet = self.op, self.fleet
        m0, api0, cpu0, t0 = op.metrics(), self.env.apiserver_requests(), op.cpu_seconds(), time.monotonic()
        machine0 = machine_cpu()
        start = time.time()
        fleet.freeze({run: start + at for run, at in freeze_in.items()})
        self.frozen |= set(freeze_in)
        # The renewals are counted between two instants, and the window reported (which the scale
        # smoke test judges the audit log's Lease writes over) is those instants: under load the
        # scrapes around it take seconds, which would otherwise fall inside one and not the other.
        renewals0, counted_from = fleet.stats().counts["renewals"], time.time()
        spy = op.profile(window - 5, profile) if profile is not None else None
        rss_peak = 0.0
        while time.monotonic() - t0 < window:
            rss_peak = max(rss_peak, op.rss_mib())
            time.sleep(5)  # sampling period of the RSS probe
        stats, counted_to = fleet.stats(), time.time()
        elapsed = time.monotonic() - t0
        m1, api1, cpu1 = op.metrics(), self.env.apiserver_requests(), op.cpu_seconds()
        machine1 = machine_cpu()
        renewals = stats.counts["renewals"] - renewals0
        api = api1 - api0
        lost = _lost_attempts(self.env, self.ns)
        played = list(stats.played.values())
        detect = [lost[p.run][0] - p.last_renewal for p in played
                  if p.ended == "frozen" and p.run in freeze_in and p.run in lost and p.last_renewal is not None
                  and p.fence == lost[p.run][1]]
        false_lost, fleet_missed = self._judge(lost, played)
        run_writes = sum(c for (res, verb), c in api.items()
                         if res.startswith("workerruns") and verb in ("PUT", "PATCH", "POST", "DELETE"))
        result = {
            "runs": self.n, "leaseSeconds": self.duration, "renewSeconds": self.renew,
            "windowSeconds": round(elapsed, 1), "window": [counted_from, counted_to], "renewals": renewals,
            "operatorCores": round((cpu1 - cpu0) / elapsed, 3), "operatorRssMiBPeak": round(rss_peak, 1),
            "renewalsPerSecond": round(renewals / elapsed, 1),
            "apiWritesPerHeartbeat": {
                "leases": round(api[("leases", "PUT")] / max(renewals, 1), 3),
                "workerruns": round(run_writes / max(renewals, 1), 3),
                # Net of what each lapse in the window costs by design (its revocation, re-grant and
                # the next attempt's Running: 3 status writes): what heartbeats themselves cost.
                "workerrunsNetOfLapses": round(max(0, run_writes - 3 * (len(detect) + len(fleet_missed)))
                                               / max(renewals, 1), 4)},
            "operatorRequestsPerHeartbeat": round((requests_sent(m1) - requests_sent(m0)) / max(renewals, 1), 4),
            "apiWritesInWindow": {f"{res} {verb}": c for (res, verb), c in api.items()
                                  if verb in ("PUT", "PATCH", "POST", "DELETE", "APPLY") and c},
            "watchLagSeconds": {"p50": histogram_quantile(m1, "tether_lease_watch_lag_seconds", 0.5),
                                "p99": histogram_quantile(m1, "tether_lease_watch_lag_seconds", 0.99)},
            "lapseDetectionSeconds": summary(detect), "lapsesSampled": len(freeze_in),
            "falseLost": len(false_lost), "falseLostRuns": false_lost[:10],
            "fleetMissedRenewals": {"lost": len(fleet_missed), "runs": fleet_missed[:10]},
            # What the fleet saw of the first few lost runs: was it the workers or Tether?
            "lostSeenByFleet": [
                {"run": p.run, "fence": p.fence, "renewals": p.renewals, "ended": p.ended,
                 "lastRenewalAnsweredBeforeLoss": None if (t := _last_before(p.answered, lost[p.run][0])) is None
                 else round(lost[p.run][0] - t, 1),
                 "renewalsAnsweredAfterLoss": sum(1 for a in p.answered if a > lost[p.run][0])}
                for p in played if p.run in (false_lost[:5] + fleet_missed[:5]) and p.fence == lost[p.run][1]],
            "fleetCounts": dict(stats.counts),
            "fleetWidestRenewalGap": {"seconds": round(stats.widest_gap[0], 1),
                                      "endedAgo": round(time.time() - stats.widest_gap[1], 1)
                                      if stats.widest_gap[1] else None, "run": stats.widest_gap[2]},
            "fleetRenewalSeconds": summary(list(stats.renew_seconds)),
            "fleetQueueSeconds": summary(list(stats.slot_wait_seconds)),
            "machineCores": {k: round((machine1.get(k, 0.0) - v) / elapsed, 3) for k, v in machine0.items()},
        }
        if spy is not None and profile is not None:
            spy.wait(timeout=60)
            if profile.exists():
                result["operatorProfile"] = {"file": str(profile), **profile_summary(profile)}
        print(f"  steady {self.n} L={self.duration}: {json.dumps(result)}", flush=True)
        return result

    def _judge(self, lost: dict[str, tuple[float, int]], played: list[Played]) -> tuple[list[str], list[str]]:
        """Splits unsampled LeaseLost attempts into Tether's errors and the fleet's own misses. A
        loss is the fleet's when the last renewal the API server accepted before it (its answer
        came before the loss, so the write landed earlier still) is a lease old at the loss: the
        load generator itself did not renew in time, and the loss was right."""
        answered = {(p.run, p.fence): p.answered for p in played}
        unsampled = {r: v for r, v in lost.items() if r not in self.frozen}
        missed = sorted(r for r, (at, fence) in unsampled.items()
                        if (t := _last_before(answered.get((r, fence), []), at)) is not None
                        and at - t >= self.duration - 1)
        return sorted(r for r in unsampled if r not in missed), missed

    def restart(self, profile: Path | None = None) -> dict[str, Any]:
        """kill -9 of the operator; a new one starts at once. Until when does it know every run again,
        what does it send meanwhile (its own request counter, 1 s samples), and is anyone lost?
        With `profile`, py-spy samples the new operator's first 30 s into that file."""
        lost_before = set(_lost_attempts(self.env, self.ns))
        self.op.kill()
        killed = time.monotonic()
        self.op.start()
        spy = self.op.profile(30, profile) if profile is not None else None
        per_second: list[float] = []
        seen_at, last = None, 0.0
        while time.monotonic() - killed < 2 * self.duration + 10:
            m = self.op.metrics(["rest_client_requests_total", "tether_workerruns"])
            sent = requests_sent(m)
            per_second.append(sent - last)
            last = sent
            known = sum(v for k, v in m.items() if k.startswith("tether_workerruns{"))
            if seen_at is None and known >= self.n:
                seen_at = time.monotonic() - killed
            time.sleep(1)  # the sampling period of the burst profile
        after = _lost_attempts(self.env, self.ns)
        false_lost, fleet_missed = self._judge({r: v for r, v in after.items() if r not in lost_before},
                                               list(self.fleet.stats().played.values()))
        result = {"runs": self.n, "leaseSeconds": self.duration,
                  "allObservedAfterSeconds": None if seen_at is None else round(seen_at, 1),
                  "requestsAfterRestart": int(sum(per_second)), "peakRequestsPerSecond": max(per_second, default=0),
                  "requestsPerSecond": per_second, "falseLost": len(false_lost),
                  "fleetMissedRenewals": len(fleet_missed),
                  "qps": self.env.qps, "burst": self.env.burst}
        if spy is not None and profile is not None:
            spy.wait(timeout=60)
            if profile.exists():
                result["operatorProfile"] = {"file": str(profile), **profile_summary(profile)}
        print(f"  restart {self.n}: { {k: v for k, v in result.items() if k != 'requestsPerSecond'} }", flush=True)
        return result

    def close(self) -> None:
        self.fleet.stop()
        self.op.stop()


# What a write is, in apiserver_request_total's verbs.
WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE", "APPLY")


def burst(env: Env, n: int, timeout: float = 600) -> dict[str, Any]:
    """N External runs created at once (as fast as 16 connections go): create -> granted (the
    status names a holder) for each, until the last is granted, and what the grants cost: the API
    server's writes per grant by resource and verb (its own counters, less the benchmark's creates:
    on a private control plane, the operator's writes), the operator's CPU per grant."""
    ns = env.namespace("burst")
    op = Operator(env, ns)
    watch = Times(env, WR.format(ns=ns), lambda r: [("granted", r["metadata"]["name"])]
                  if (r.get("status") or {}).get("holder") else [])
    try:
        before, cpu = env.apiserver_requests(), op.cpu_seconds()
        began = time.time()
        sent = create_paced(env, WR.format(ns=ns), [external_run(f"x{i}") for i in range(n)], None)
        wait_for(lambda: len(watch.of("granted")) >= n, timeout=timeout, what=f"{n} External runs granted")

        def leased() -> bool:  # a grant writes the status, then the Lease: the window holds both
            items = env.api.get(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases").raise_for_status().json()["items"]
            return sum(1 for x in items if (x.get("spec") or {}).get("holderIdentity")) >= n
        wait_for(leased, timeout=timeout, what=f"{n} grants' Leases")
        ended = time.time()
        cpu = op.cpu_seconds() - cpu
        after = env.apiserver_requests()
    finally:
        watch.stop()
        op.stop()
    granted = watch.of("granted")
    writes = {f"{verb} {res}": round((count - before.get((res, verb), 0) - (n if (res, verb) == ("workerruns", "POST")
                                                                             else 0)) / n, 2)
              for (res, verb), count in sorted(after.items()) if verb in WRITE_VERBS}
    return {"runs": n, "namespace": ns, "window": [began, ended],
            "createToGranted": summary([granted[k] - sent[k] for k in sent if k in granted]),
            "allGrantedSeconds": round(max(granted.values()) - began, 2),
            "grantsPerSecond": round(n / (max(granted.values()) - began), 1),
            "writesPerGrant": {k: v for k, v in writes.items() if v > 0},
            # Reads the operator sent (the watcher's one LIST is under 0.01 a grant).
            "readsPerGrant": {f"GET {res}": round((count - before.get((res, verb), 0)) / n, 2)
                              for (res, verb), count in sorted(after.items())
                              if verb == "GET" and count - before.get((res, verb), 0) >= n / 100},
            "operatorCpuMsPerGrant": round(1000 * cpu / n, 2)}


def _lost_attempts(env: Env, ns: str) -> dict[str, tuple[float, int]]:
    """Run name -> when its first LeaseLost attempt ended (the operator's endedAt), and its fence."""
    out: dict[str, tuple[float, int]] = {}
    for run in env.api.get(WR.format(ns=ns)).raise_for_status().json()["items"]:
        for a in (run.get("status") or {}).get("attempts") or []:
            if a.get("outcome") == "LeaseLost" and a.get("endedAt"):
                out.setdefault(run["metadata"]["name"],
                               (dt.datetime.fromisoformat(a["endedAt"].replace("Z", "+00:00")).timestamp(),
                                int(a.get("fence") or 0)))
    return out


def _last_before(times: list[float], at: float) -> float | None:
    return max((t for t in times if t < at), default=None)


# The processes whose CPU a measurement window reports, besides the operator's.
MACHINE = ("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler", "kwok")


def machine_cpu() -> dict[str, float]:
    """CPU seconds so far of the control plane's processes and the fleet (by name, summed)."""
    out: dict[str, float] = {}
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            name = proc.info["name"] or ""
            key = next((m for m in MACHINE if name.startswith(m[:15])), None)
            if key is None and "multiprocessing" in " ".join(proc.info["cmdline"] or []):
                key = "fleet"
            if key is not None:
                t = proc.cpu_times()
                out[key] = out.get(key, 0.0) + t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def budget_load(env: Env, n: int, duration: int, renew: int, window: float) -> dict[str, Any]:
    """N runs on one WorkerBudget, each reporting one more cent with every renewal."""
    pop = Population(env, f"budget-{n}", duration, renew, plan=Plan(cents_per_renewal=1), budget="team")
    ns, op = pop.ns, pop.op
    path = f"/apis/tether.dev/v1alpha1/namespaces/{ns}/workerbudgets/team"
    sizes: list[int] = []
    try:
        pop.grow(n)
        m0, api0, cpu0, t0 = op.metrics(), env.apiserver_requests(), op.cpu_seconds(), time.monotonic()
        reported0 = pop.fleet.stats().counts["renewals"]
        while time.monotonic() - t0 < window:
            sizes.append(len(env.api.get(path).content))
            time.sleep(5)  # sampling period of the budget's size
        elapsed = time.monotonic() - t0
        m1, api1, cpu1 = op.metrics(), env.apiserver_requests(), op.cpu_seconds()
        stats = pop.fleet.stats()
        runs = env.api.get(WR.format(ns=ns)).raise_for_status().json()["items"]
        budget = env.api.get(path).json()
    finally:
        pop.close()
    marks = (budget.get("status") or {}).get("charges") or {}
    starved = [r["metadata"]["name"] for r in runs
               if ((r.get("status") or {}).get("usage") or {}).get("cents", 0) > 0
               and int((marks.get(r["metadata"]["uid"]) or {}).get("cents", 0)) == 0]
    reconciles = sum(v for k, v in m1.items() if k.startswith("controller_runtime_reconcile_total{")) - \
        sum(v for k, v in m0.items() if k.startswith("controller_runtime_reconcile_total{"))
    conflicts = m1.get("tether_budget_charge_conflicts_total", 0) - m0.get("tether_budget_charge_conflicts_total", 0)
    charged = m1.get('tether_budget_charged_cents_total{budget="team",namespace="%s"}' % ns, 0) - \
        m0.get('tether_budget_charged_cents_total{budget="team",namespace="%s"}' % ns, 0)
    result = {"runs": n, "leaseSeconds": duration, "renewSeconds": renew, "windowSeconds": round(elapsed, 1),
              "chargeConflictsPerSecond": round(conflicts / elapsed, 2),
              "centsChargedPerSecond": round(charged / elapsed, 1),
              # One cent rides on every renewal: what the workers reported, and what of it the budget
              # did not show yet at the end (usage reaches the status once per fold interval).
              "centsReportedPerSecond": round((stats.counts["renewals"] - reported0) / elapsed, 1),
              "unchargedAtEndCents": sum(p.renewals for p in stats.played.values() if p.fence == 1)
              - int(((budget.get("status") or {}).get("spent") or {}).get("cents", 0)),
              "budgetWritesPerSecond": round((api1 - api0)[("workerbudgets/status", "PUT")] / elapsed, 2),
              "runStatusWritesPerSecond": round((api1 - api0)[("workerruns/status", "PUT")] / elapsed, 1),
              "operatorCores": round((cpu1 - cpu0) / elapsed, 3),
              "reconcilesPerSecond": round(reconciles / elapsed, 1),
              "budgetBytes": {"max": max(sizes, default=0), "end": sizes[-1] if sizes else 0},
              "starvedRuns": len(starved), "spent": (budget.get("status") or {}).get("spent")}
    print(f"  budget {n}: {json.dumps(result)}", flush=True)
    return result


def ceiling(pop: Population, step: int, limit: int, window: float, goals: dict[str, float]) -> dict[str, Any]:
    """Grows a population step by step until a goal breaks (or `limit`)."""
    steps = []
    while pop.n + step <= limit:
        ramp = pop.grow(pop.n + step)
        result = pop.measure(window, lapses=20, seed=pop.n)
        broken = [name for name, ok in _goals(result, goals).items() if not ok]
        steps.append({"runs": pop.n, "rampSeconds": round(ramp, 1), "broken": broken,
                      "operatorCores": result["operatorCores"], "operatorRssMiBPeak": result["operatorRssMiBPeak"],
                      "lapseP99": result["lapseDetectionSeconds"].get("p99"), "falseLost": result["falseLost"],
                      "fleetMissed": result["fleetMissedRenewals"]["lost"], "machineCores": result["machineCores"],
                      "renewalsPerSecond": result["renewalsPerSecond"]})
        print(f"  ceiling {pop.n}: broken {broken}", flush=True)
        if broken:
            return {"steps": steps, "ceiling": pop.n - step, "firstBroken": broken}
    return {"steps": steps, "ceiling": None, "firstBroken": [], "note": f"no goal broke up to {pop.n}"}


def _goals(steady_result: dict[str, Any], goals: dict[str, float]) -> dict[str, bool]:
    lapse = steady_result["lapseDetectionSeconds"].get("p99")
    return {
        "cores": steady_result["operatorCores"] <= goals["cores"],
        "rss": steady_result["operatorRssMiBPeak"] <= goals["rssMiB"],
        "leaseWritesPerHeartbeat": steady_result["apiWritesPerHeartbeat"]["leases"] <= 1.05,
        "runWritesPerHeartbeat": steady_result["apiWritesPerHeartbeat"]["workerrunsNetOfLapses"] <= 0.01,
        "lapseP99": lapse is None or lapse <= steady_result["leaseSeconds"] + 2,
        "falseLost": steady_result["falseLost"] == 0,
        # Not Tether's goal but the measurement's: past it, the load generator is what gives out.
        "fleetKeptUp": steady_result["fleetMissedRenewals"]["lost"] == 0,
    }


GOALS = {"cores": 0.5, "rssMiB": 300}
SCENARIOS = ("launch", "burst", "steady", "restart", "budget", "ceiling")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--runs", type=int, default=5000, help="live runs in steady/restart")
    parser.add_argument("--launch-runs", type=int, default=1000)
    parser.add_argument("--burst-runs", type=int, default=1000, help="External runs created at once (burst)")
    parser.add_argument("--lapses", type=int, default=100)
    parser.add_argument("--window", type=float, default=180, help="steady-state measuring window, seconds")
    parser.add_argument("--kwok-nodes", type=int, default=4)
    parser.add_argument("--qps", type=float, default=100)
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ramp-rate", type=float, default=50, help="runs created per second while a population grows")
    parser.add_argument("--budget-runs", type=int, default=1000)
    parser.add_argument("--ceiling-step", type=int, default=2500)
    parser.add_argument("--ceiling-limit", type=int, default=10000,
                        help="most live runs the ceiling tries (2 cores: the machine gives out before)")
    parser.add_argument("--smoke", action="store_true", help="a few dozen runs, short windows (make test)")
    parser.add_argument("--out", default="")
    parser.add_argument("--operator-source", type=Path, default=None,
                        help="a checkout whose operator to run instead of this one's (e.g. a git worktree of "
                             "an older commit: old and new code measured by one harness)")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.launch_runs, args.lapses, args.window, args.burst_runs = 30, 20, 3, 45, 30
        args.budget_runs, args.ceiling_step, args.ceiling_limit = 20, 30, 60
    scenarios = args.scenarios.split(",")
    report: dict[str, Any] = {"date": dt.date.today().isoformat(), "machine": {"cpus": os.cpu_count()},
                              "tether": {"qps": args.qps, "burst": args.burst},
                              "kubeControllerManager": {"qps": KCM_QPS, "burst": KCM_BURST},
                              "smoke": args.smoke}
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"scale-{report['date']}{'-smoke' if args.smoke else ''}.json")

    def profile(name: str) -> Path | None:
        return None if args.smoke else out.with_name(f"{out.stem}-profile-{name}.txt")

    if args.operator_source is not None:
        report["operatorSource"] = subprocess.run(["git", "-C", str(args.operator_source), "rev-parse", "--short",
                                                   "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    with environment(args.kwok_nodes, args.qps, args.burst, operator_source=args.operator_source) as env:
        if "launch" in scenarios:
            report["launch"] = [launch(env, args.launch_runs, 20, "jobs"),
                                launch(env, args.launch_runs, None, "tether")]
        if "burst" in scenarios:
            report["burst"] = burst(env, args.burst_runs)
        long_lease = (90, 30) if not args.smoke else (20, 5)
        short_lease = (30, 10) if not args.smoke else (12, 3)
        if {"steady", "restart", "ceiling"} & set(scenarios):
            pop = Population(env, "steady-long", *long_lease, ramp_rate=args.ramp_rate)
            try:
                ramp = pop.grow(args.runs)
                report["steady"] = [{**pop.measure(args.window, args.lapses, args.seed, profile=profile("long")),
                                     "rampSeconds": round(ramp, 1)}]
                if "restart" in scenarios:
                    report["restart"] = pop.restart(profile=profile("restart"))
                if "ceiling" in scenarios:
                    report["ceiling"] = ceiling(pop, args.ceiling_step, args.ceiling_limit, args.window, GOALS)
            finally:
                pop.close()
        if "steady" in scenarios:
            pop = Population(env, "steady-short", *short_lease, ramp_rate=args.ramp_rate)
            try:
                ramp = pop.grow(args.runs)
                report["steady"].append({**pop.measure(args.window, args.lapses, args.seed + 1,
                                                       profile=profile("short")),
                                         "rampSeconds": round(ramp, 1)})
            finally:
                pop.close()
        if "budget" in scenarios:
            report["budget"] = budget_load(env, args.budget_runs, *short_lease, args.window)
        report["goals"] = {f"steady {s['runs']} L={s['leaseSeconds']}": _goals(s, GOALS)
                           for s in report.get("steady", [])}
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
