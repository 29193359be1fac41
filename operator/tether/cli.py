"""The `tether` command line."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tether import __version__
from tether.api.models import MAX_ATTEMPT_HISTORY
from tether.devcluster import fake_model

if TYPE_CHECKING:
    import asyncio
    from typing import Any, Awaitable

    from tether.kube.client import KubeClient


def _dev_cluster(args: argparse.Namespace) -> int:
    from tether.devcluster.controlplane import LocalCluster, resolve_binaries
    from tether.devcluster.crds import install_crds, install_policies

    bin_dir = resolve_binaries()
    state = Path(args.state_dir).resolve() if args.state_dir else Path.cwd() / ".tether" / "cluster"
    state.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(bin_dir=bin_dir, state_dir=state, real_node=args.real_node, with_kueue=args.kueue)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with cluster:
        with cluster.client() as client:
            install_crds(client)
            install_policies(client)
        print(f"# control plane up in {cluster.startup_seconds:.1f}s; logs in {cluster.log_dir}")
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        print(f"export PATH={bin_dir}:$PATH   # kubectl {os.path.basename(str(bin_dir))}")
        if cluster.node is not None:
            from tether.devcluster.realnode import REAL_NODE_NAME, REAL_NODE_TAINT

            print(f"# real node {REAL_NODE_NAME} (kubelet + containerd, netns {cluster.node.network.netns}); "
                  f"pods go there with nodeSelector {REAL_NODE_TAINT}=true and a toleration of that taint")
            print(f"# images: {cluster.node.images['TETHER_IMAGE']} and {cluster.node.images['EXAMPLE_IMAGE']}")
        if cluster.kueue is not None:
            print(f"# Kueue's manager runs (WorkerRun is its external framework; log {cluster.kueue.log_dir / 'kueue.log'}): "
                  "kubectl apply -f examples/queues/tenancy.yaml, then label runs kueue.x-k8s.io/queue-name")
        print("# Ctrl-C stops the cluster and removes its state.", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


def _operator(args: argparse.Namespace) -> int:
    import asyncio

    from tether import logs

    logs.setup(logging.DEBUG if args.verbose else logging.INFO)
    return asyncio.run(_run_operator(args))


async def _run_operator(args: argparse.Namespace) -> int:
    import asyncio
    import socket
    import uuid

    import kopf

    from tether import gcpause, metrics, tracing
    from tether.capabilities import CAPABILITIES
    from tether.controller import handlers
    from tether.controller.leader import LeaderElector
    from tether.kube import config as kubeconfig
    from tether.kube.client import KubeClient

    log = logging.getLogger("tether.operator")
    gcpause.install()
    # SIGTERM and SIGINT are handled here, from the start: in a container the operator is PID 1, and
    # PID 1 without a handler ignores SIGTERM, so a standby (kopf not started yet) would otherwise
    # sit out the whole grace period and be killed.
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()

    def own_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)

    own_signals()
    tracing.configure()  # OTEL_* environment; off (no SDK loaded) unless an exporter is configured
    # tether_leader: 0 from the first scrape until this replica holds the Lease (with an election).
    metrics.LEADER.set(0 if args.leader_elect else 1)
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    # Liveness from the first moment, not kopf's (it starts with kopf, after leadership): a
    # standby with no endpoint would fail its probe and be restarted again and again.
    liveness = await _serve_liveness(args.liveness) if args.liveness else None
    gateway = _Gateway(args) if args.gateway_port else None
    await _check_server(log)
    elector = None
    if args.leader_elect:
        cfg = await asyncio.to_thread(kubeconfig.load)  # it may run an exec credential plugin
        namespace = args.leader_election_namespace or os.environ.get("POD_NAMESPACE") or cfg.namespace
        identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
        kube = KubeClient(cfg)
        elector = LeaderElector(kube, namespace, args.leader_election_id, identity,
                                lease_seconds=args.leader_lease_seconds,
                                renew_deadline=args.leader_lease_seconds * 2 / 3,
                                retry_period=max(1.0, args.leader_lease_seconds / 7.5),
                                owner=await _lease_owner(kube, namespace))
        if not await _until_stopped(elector.acquire(), stopping):
            # A Lease write in flight when the stop came may have landed: give it back.
            await elector.release()
            if gateway is not None:
                await gateway.stop()
            log.info("stopped before leadership", extra={"event": "operator_stopped"})
            return 0
        metrics.LEADER.set(1)
    settings = handlers.Settings(qps=args.kube_qps, burst=args.kube_burst, workers=args.max_concurrent_reconciles,
                                 event_qps=args.event_qps, event_burst=2 * max(1, int(args.event_qps)),
                                 worker_identity=args.worker_identity, attempt_history=args.attempt_history,
                                 capabilities=CAPABILITIES)
    if elector is not None:
        settings.may_act = lambda: elector.is_leader

    namespaces = args.namespace or []
    # kopf stops gracefully (its handlers finish) when `stopping` is set: a signal that came before
    # it started is not lost. It installs its own signal handlers as it starts; ours go back once
    # it is ready, so that one flag stops everything (kopf waits on its stop flag when it ends).
    # Created before kopf starts, so kopf's shutdown leaves it to us (it waits on tasks born later).
    holding = asyncio.create_task(elector.hold()) if elector is not None else None
    ready = asyncio.Event()
    memo = handlers.memo(settings)
    operator = asyncio.create_task(kopf.operator(
        standalone=True,  # HA is the Lease-based election above, not kopf peering
        clusterwide=not namespaces,
        namespaces=namespaces,
        stop_flag=stopping,
        ready_flag=ready,
        memo=memo,
    ))

    async def until_first(*tasks: "asyncio.Future[Any]") -> None:
        await asyncio.wait({*tasks, *([holding] if holding is not None else [])}, return_when=asyncio.FIRST_COMPLETED)
        if holding is not None and holding.done():
            # Exit at once: a replica that lost its lease must not act again (the standby owns it now).
            log.error("leadership lost; exiting", extra={"event": "leader_lost"})
            os._exit(1)

    readiness = asyncio.ensure_future(ready.wait())
    await until_first(readiness, operator)
    readiness.cancel()
    if ready.is_set() and not operator.done():
        own_signals()
    await until_first(operator)
    if holding is not None:
        holding.cancel()
    try:
        await operator
    except Exception:  # noqa: BLE001 - kopf failed: still hand over before exiting
        log.exception("kopf stopped with an error", extra={"event": "operator_failed"})
        return 1
    finally:
        stopping.set()
        if elector is not None:
            # kopf has stopped every handler: hand the Lease over now rather than after it lapses.
            await elector.release()
        metrics.LEADER.set(0)  # leading no more
        handlers.stop_exporting(memo)
        if gateway is not None:
            await gateway.stop()
        if liveness is not None:
            await liveness.cleanup()
        # The spans still queued, off the loop, within OTEL_EXPORTER_OTLP_TIMEOUT overall.
        await asyncio.to_thread(tracing.shutdown)
    log.info("operator stopped", extra={"event": "operator_stopped"})
    return 0


async def _lease_owner(kube: "KubeClient", namespace: str) -> "dict[str, Any] | None":
    """The pod's own ServiceAccount (POD_SERVICE_ACCOUNT, set by the chart), when it lives in the
    Lease's namespace: an owner elsewhere would count as missing, and the Lease be collected at once."""
    name = os.environ.get("POD_SERVICE_ACCOUNT")
    if not name or os.environ.get("POD_NAMESPACE") != namespace:
        return None
    try:
        account = await kube.get_service_account(namespace, name)
    except Exception as exc:  # noqa: BLE001 - without an owner the Lease only outlives an uninstall
        logging.getLogger("tether.leader").warning("the leader Lease gets no owner", extra={"error": str(exc)})
        return None
    if account is None:
        return None
    return {"apiVersion": "v1", "kind": "ServiceAccount", "name": name, "uid": account["metadata"]["uid"]}


async def _check_server(log: "logging.Logger") -> None:
    """Says at start when the API server is outside the supported range (kube/support.py). A server
    that does not answer yet is not judged."""
    import asyncio

    from tether.kube import config as kubeconfig
    from tether.kube import support
    from tether.kube.client import KubeClient

    try:
        client = KubeClient(await asyncio.to_thread(kubeconfig.load))
        problem = support.version_problem(await asyncio.wait_for(client.get_object("/version"), 10) or {})
    except Exception as exc:  # noqa: BLE001 - advisory only: whatever fails here must not stop the operator
        log.warning("API server version not read", extra={"event": "server_unchecked", "error": str(exc)})
        return
    if problem is not None:
        log.error(problem, extra={"event": "server_unsupported"})


async def _serve_liveness(url: str) -> "Any":
    """GET <path> answers 200 while the event loop runs (what kopf's endpoint says too, without
    probe handlers). Returns the aiohttp runner, to clean up at exit."""
    from urllib.parse import urlparse

    from aiohttp import web

    where = urlparse(url)

    async def healthy(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get(where.path or "/healthz", healthy)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, where.hostname or "0.0.0.0", where.port or 8080).start()
    return runner


async def _until_stopped(work: "Awaitable[None]", stopping: "asyncio.Event") -> bool:
    """Runs `work` unless `stopping` is set first or meanwhile (then cancels it and waits for it to
    end); True when `work` finished and no stop was asked for."""
    import asyncio
    import contextlib

    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if not stopping.is_set():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return False


class _Gateway:
    """The gateway for external workers, in the operator's event loop (every replica serves it:
    its calls are fenced, so it needs no leadership). The operator owns the signals, not uvicorn."""

    def __init__(self, args: argparse.Namespace) -> None:
        import asyncio
        import contextlib

        import uvicorn

        from starlette.routing import Mount

        from tether.console.app import build_gateway_console
        from tether.gateway.app import build_app
        from tether.kube import config as kubeconfig
        from tether.kube.client import KubeClient

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # type: ignore[no-untyped-def,override]
                yield  # uvicorn would re-raise SIGTERM on exit, which PID 1 ignores

        # A short timeout: a caller waiting on an unreachable API server gets 503 + Retry-After soon.
        kube = KubeClient(kubeconfig.load(), timeout=5.0)
        # The shared web console (docs/console.md): each user signs in with their own bearer token,
        # and the console calls the API server with that token only.
        app = build_app(kube, audience=args.gateway_audience or None,
                        mounts=[Mount("/console", build_gateway_console(kube))])
        config = uvicorn.Config(app, host=args.gateway_host, port=args.gateway_port, log_level="warning",
                                lifespan="off", ssl_certfile=args.gateway_tls_cert or None,
                                ssl_keyfile=args.gateway_tls_key or None,
                                # A console tab holds an event stream open: shutdown must not wait on it.
                                timeout_graceful_shutdown=2)
        config.load()  # a bad TLS file fails the operator's start, not the gateway task silently
        self.server = Server(config)
        self.task = asyncio.create_task(self.server.serve())
        self.task.add_done_callback(self._ended)

    @staticmethod
    def _ended(task: "asyncio.Task[None]") -> None:
        import logging

        if not task.cancelled() and task.exception() is not None:
            logging.getLogger("tether.gateway").error("gateway stopped", exc_info=task.exception(),
                                                      extra={"event": "gateway_failed"})

    async def stop(self) -> None:
        """Ends the gateway; one that failed earlier (logged then) ends no differently."""
        import asyncio

        self.server.should_exit = True
        await asyncio.gather(self.task, return_exceptions=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether",
        description="Tether: a Kubernetes control plane for long-running worker jobs.",
    )
    parser.add_argument("--version", action="version", version=f"tether {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    op = sub.add_parser("operator", help="run the operator (reconciles WorkerRuns)")
    op.add_argument("-n", "--namespace", action="append",
                    help="watch only this namespace (repeatable); default: all namespaces")
    op.add_argument("--liveness", default=None,
                    help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    op.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0: off)")
    op.add_argument("--leader-elect", action="store_true",
                    help="run as one of several replicas: only the holder of a Lease acts")
    op.add_argument("--leader-election-namespace", default="",
                    help="namespace of the leader Lease (default: $POD_NAMESPACE, else the kubeconfig's)")
    op.add_argument("--leader-election-id", default="tether-operator-leader", help="name of the leader Lease")
    op.add_argument("--leader-lease-seconds", type=float, default=15.0,
                    help="leader lease duration; a standby takes over within it")
    op.add_argument("--gateway-port", type=int, default=0, help="serve the external-worker gateway here (0: off)")
    op.add_argument("--gateway-host", default="0.0.0.0", help="address the gateway binds")
    op.add_argument("--gateway-tls-cert", default="", help="TLS certificate file for the gateway")
    op.add_argument("--gateway-tls-key", default="", help="TLS key file for the gateway")
    op.add_argument("--gateway-audience", default="tether-gateway",
                    help="audience callers' tokens must carry (TokenReview); empty: the API server's")
    op.add_argument("--kube-qps", type=float, default=float(os.environ.get("TETHER_KUBE_QPS", "100")),
                    help="client-side limit on API requests per second, like client-go's QPS (watches excluded)")
    op.add_argument("--kube-burst", type=int, default=int(os.environ.get("TETHER_KUBE_BURST", "200")),
                    help="requests allowed at once above --kube-qps, like client-go's Burst")
    op.add_argument("--max-concurrent-reconciles", type=int,
                    default=int(os.environ.get("TETHER_MAX_CONCURRENT_RECONCILES", "16")),
                    help="runs reconciled at the same time (controller-runtime's MaxConcurrentReconciles)")
    op.add_argument("--event-qps", type=float, default=float(os.environ.get("TETHER_EVENT_QPS", "25")),
                    help="Events posted per second at most (burst twice that); beyond it they are dropped and "
                         "counted (tether_events_dropped_total), never queued ahead of reconciles")
    op.add_argument("--worker-identity", choices=("namespace", "run"),
                    default=os.environ.get("TETHER_WORKER_IDENTITY", "namespace"),
                    help="ServiceAccount of pod-backed runs: one per namespace (needs the admission policy, which "
                         "scopes each pod's token to its own run) or one per run, with a Role naming that run only")
    op.add_argument("--attempt-history", type=_history_limit,
                    default=os.environ.get("TETHER_ATTEMPT_HISTORY", str(MAX_ATTEMPT_HISTORY)),
                    help=f"attempt records a run's status.attempts keeps, 1 to {MAX_ATTEMPT_HISTORY} (the default); what "
                         "older attempts spent stays counted in status.trimmedUsage")
    op.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    op.set_defaults(func=_operator)

    dev = sub.add_parser("dev", help="development helpers (local control plane)")
    dev_sub = dev.add_subparsers(dest="dev_command", metavar="DEV_COMMAND")
    cl = dev_sub.add_parser("cluster", help="start a local control plane and print its KUBECONFIG")
    cl.add_argument("--state-dir", help="where certificates, etcd data and logs go (default ./.tether/cluster)")
    cl.add_argument("--kueue", action="store_true",
                    help="also start Kueue's manager (built from Go modules by hack/build-kueue.sh, cached), configured "
                         "for WorkerRuns as docs/queues.md says")
    cl.add_argument("--real-node", action="store_true",
                    help="also start a real node (kubelet + containerd, as root) with the Tether image built "
                         "from this checkout; builds them on first use")
    cl.set_defaults(func=_dev_cluster)
    demo = dev_sub.add_parser("demo", help="the main job on a local cluster: examples, a frozen worker, timelines")
    demo.set_defaults(func=lambda _args: __import__("tether.devcluster.demo", fromlist=["main"]).main())
    model = dev_sub.add_parser("fake-model", help="a fake OpenAI-compatible model API whose answers bill tokens "
                                                  "(for trying the examples without a key)")
    fake_model.arguments(model)
    model.set_defaults(func=fake_model.serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    # First thing: in a container `tether` is PID 1, which ignores SIGTERM without a handler, and
    # importing the operator takes a while under load. A SIGTERM that comes meanwhile ends it as any
    # other process (143); the operator replaces this with its own handling once it runs.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    return int(func(args) or 0)


def _history_limit(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_ATTEMPT_HISTORY:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_ATTEMPT_HISTORY}, not {value}")
    return value


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
