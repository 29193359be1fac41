"""A real node beside the process kubelet: kubelet v1.36 + containerd 2 + Debian's runc.

The node lives in a network namespace of its own, joined to the host by a veth pair, so it has a
routable, non-loopback address (the kubelet refuses a loopback node IP) and no byte leaves this
machine: the node routes only to its link and the `kubernetes` Service, and the host drops anything
forwarded from it. Addresses are in 198.18.0.0/15 (reserved for benchmarking, RFC 2544):

    host side of the veth   198.18.N.1   the API server is reached here, through a TCP forwarder
    node (kubelet, CRI)     198.18.N.2   InternalIP; the API server reaches the kubelet here (logs)
    pods (CNI bridge)       198.19.N.0/24
    `kubernetes` Service    198.18.255.1 (SERVICE_CIDR): there is no kube-proxy, so the node's
                            netfilter sends it to the forwarder, and in-cluster clients work as is

cgroups: the machine mounts cgroup v1 (kubelet needs failCgroupV1: false) and each node keeps its
pods under a cgroup root of its own. runc cannot raise oom_score_adj here (no CAP_SYS_RESOURCE):
containerd restricts it. Binaries come from hack/build-node.sh, images from hack/build-images.sh.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from tether.devcluster import pki
from tether.devcluster.processes import spawn, terminate, wait_for

SERVICE_CIDR = "198.18.255.0/24"
KUBERNETES_SERVICE_IP = "198.18.255.1"
REAL_NODE_NAME = "tether-real-node"
REAL_NODE_LABEL = "tether.dev/real-node"
# Pods land on the real node only when they ask: the fast, fault-injecting tests keep the process kubelet.
REAL_NODE_TAINT = "tether.dev/real-node"
APISERVER_FORWARD_PORT = 6443
_CGROUP_V1 = Path("/sys/fs/cgroup")


def real_node_placement() -> dict[str, object]:
    """Pod spec fields that put a pod on the real node (and only there)."""
    return {"nodeSelector": {REAL_NODE_LABEL: "true"},
            "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}]}


def _run(*argv: str) -> str:
    return subprocess.run(argv, check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True).stdout


@dataclass(frozen=True)
class NodeNetwork:
    """The addresses of one node (see the module docstring); `index` is N."""

    index: int

    @classmethod
    def pick(cls) -> "NodeNetwork":
        """Claims a link subnet no other cluster uses (several may start at once): the first N whose
        addresses and routes are unused and whose namespace `ip netns add` creates (it fails when
        the namespace exists, so two clusters never claim the same N)."""
        used = _run("ip", "-o", "-4", "addr", "show") + _run("ip", "-4", "route", "show")
        for index in [*range(os.getpid() % 250, 250), *range(0, os.getpid() % 250)]:
            network = cls(index)
            if f"198.18.{index}." in used or f"198.19.{index}." in used:
                continue
            try:
                _run("ip", "netns", "add", network.netns)
            except subprocess.CalledProcessError:
                continue  # another cluster's, or one left behind by a killed run
            return network
        raise RuntimeError("no free 198.18.N.0/24 link subnet for a real node")

    @property
    def netns(self) -> str:
        return f"tether-node-{self.index}"

    @property
    def host_ip(self) -> str:
        return f"198.18.{self.index}.1"

    @property
    def node_ip(self) -> str:
        return f"198.18.{self.index}.2"

    @property
    def pod_cidr(self) -> str:
        return f"198.19.{self.index}.0/24"

    @property
    def host_veth(self) -> str:
        return f"tth{self.index}h"

    @property
    def node_veth(self) -> str:
        return f"tth{self.index}n"

    def exec_argv(self, *argv: str) -> list[str]:
        """`argv` run inside the node's network namespace, and only that: `ip netns exec` would also
        remount /sys, hiding the cgroup mounts from the kubelet."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--", *argv]

    def create(self) -> None:
        """Sets up the namespace `pick` claimed. Nothing leaves this machine: the node has routes to
        its link and the `kubernetes` Service only (no default route), and the host drops whatever
        would be forwarded from the node's veth."""
        _run("ip", "link", "add", self.host_veth, "type", "veth", "peer", "name", self.node_veth)
        _run("ip", "link", "set", self.node_veth, "netns", self.netns)
        _run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_veth)
        _run("ip", "link", "set", self.host_veth, "up")
        # Replies to pods go back through the node.
        _run("ip", "route", "add", self.pod_cidr, "via", self.node_ip)
        inside = lambda *a: _run(*self.exec_argv(*a))  # noqa: E731
        inside("ip", "link", "set", "lo", "up")
        inside("ip", "addr", "add", f"{self.node_ip}/24", "dev", self.node_veth)
        inside("ip", "link", "set", self.node_veth, "up")
        # Without this route the node's own connections to the Service fail before OUTPUT's DNAT.
        inside("ip", "route", "add", f"{KUBERNETES_SERVICE_IP}/32", "via", self.host_ip)
        inside("sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        _run("iptables", "-I", "FORWARD", "-i", self.host_veth, "-j", "DROP")
        # The `kubernetes` Service, as kube-proxy would route it, for pods (PREROUTING) and the node (OUTPUT).
        to = f"{self.host_ip}:{APISERVER_FORWARD_PORT}"
        for chain in ("PREROUTING", "OUTPUT"):
            inside("iptables", "-t", "nat", "-A", chain, "-d", KUBERNETES_SERVICE_IP, "-p", "tcp",
                   "--dport", "443", "-j", "DNAT", "--to-destination", to)

    def delete(self) -> None:
        # The veth pair and everything inside go with the namespace; the host route with the veth.
        subprocess.run(["ip", "netns", "delete", self.netns], stderr=subprocess.DEVNULL, check=False)
        subprocess.run(["ip", "link", "delete", self.host_veth], stderr=subprocess.DEVNULL, check=False)
        while subprocess.run(["iptables", "-D", "FORWARD", "-i", self.host_veth, "-j", "DROP"],
                             stderr=subprocess.DEVNULL, check=False).returncode == 0:
            pass

    def cut(self, pod_ip: str) -> None:
        """Drops every packet from and to one pod, as a network partition would (established
        connections included); `heal` undoes it."""
        for rule in (["-s", pod_ip], ["-d", pod_ip]):
            _run(*self.exec_argv("iptables", "-I", "FORWARD", *rule, "-j", "DROP"))

    def heal(self, pod_ip: str) -> None:
        for rule in (["-s", pod_ip], ["-d", pod_ip]):
            _run(*self.exec_argv("iptables", "-D", "FORWARD", *rule, "-j", "DROP"))


def resolve_node_binaries(build: Callable[[str, str], Path]) -> Path:
    explicit = os.environ.get("TETHER_NODE_BIN")
    return Path(explicit) if explicit else build("build-node.sh", "kubelet and containerd")


def resolve_images(build: Callable[[str, str], Path]) -> dict[str, str]:
    """The image archives and their names (hack/build-images.sh's images.env, plus `dir`)."""
    explicit = os.environ.get("TETHER_NODE_IMAGES")
    directory = Path(explicit) if explicit else build("build-images.sh", "node images")
    env = dict(line.split("=", 1) for line in (directory / "images.env").read_text().split())
    return {**env, "dir": str(directory)}


@dataclass
class RealNode:
    """kubelet and containerd for one cluster; started and stopped by LocalCluster."""

    state_dir: Path
    bin_dir: Path
    images: dict[str, str]
    network: NodeNetwork
    log_dir: Path
    _procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        # containerd's state holds shim sockets: a short path, under 108 bytes.
        return Path(f"/run/tether-node-{self.network.index}")

    @property
    def containerd_socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def cgroup_root(self) -> str:
        return f"/tether-node-{self.network.index}"

    def start(self, server_ca: pki.CertPair, ca: pki.CertificateAuthority, write_kubeconfig: Callable[..., Path],
              apiserver: str) -> None:
        """Needs the API server listening on `apiserver` (loopback) and its serving certificate
        naming network.host_ip."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.network.create()
        host, _, port = apiserver.rpartition("://")[2].rpartition(":")
        self._spawn("apiserver-forward", [sys.executable, "-m", "tether.devcluster.forward",
                                          f"{self.network.host_ip}:{APISERVER_FORWARD_PORT}", f"{host}:{port}"],
                    inside=False)
        self._make_cgroup_root()
        self._start_containerd()
        self._import_images()
        creds = ca.issue("real-node", f"system:node:{REAL_NODE_NAME}", ("system:nodes",))
        kubeconfig = write_kubeconfig(self.state_dir / "kubelet.kubeconfig", creds, "kubelet",
                                      server=f"https://{self.network.host_ip}:{APISERVER_FORWARD_PORT}")
        self._start_kubelet(kubeconfig, server_ca)

    def describe(self) -> dict[str, object]:
        """What a test needs to reach into the node (JSON-ready)."""
        return {"index": self.network.index, "containerdSocket": str(self.containerd_socket),
                "ctr": str(self.bin_dir / "ctr"), "images": self.images}

    def _spawn(self, name: str, argv: list[str], inside: bool = True, env: dict[str, str] | None = None) -> None:
        full = self.network.exec_argv(*argv) if inside else argv
        self._procs.append((name, spawn(full, log_path=self.log_dir / f"{name}.log", env=env)))

    def check_alive(self) -> None:
        for name, proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.log_dir / name}.log")

    # --- containerd ------------------------------------------------------

    def _start_containerd(self) -> None:
        cni_conf = self.state_dir / "cni" / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        net = ipaddress.ip_network(self.network.pod_cidr)
        (cni_conf / "10-tether.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "tether-pods",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
                 "ipam": {"type": "host-local", "dataDir": str(self.state_dir / "cni" / "ipam"),
                          "ranges": [[{"subnet": str(net), "gateway": str(net.network_address + 1)}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }))
        config = self.state_dir / "containerd.toml"
        config.write_text("\n".join([
            "version = 3",
            f"root = '{self.state_dir / 'containerd'}'",
            f"state = '{self.run_dir / 'state'}'",
            "[grpc]",
            f"  address = '{self.containerd_socket}'",
            "[ttrpc]",
            f"  address = '{self.run_dir / 'ttrpc.sock'}'",
            "[plugins.'io.containerd.cri.v1.runtime']",
            # No CAP_SYS_RESOURCE here: runc fails to raise oom_score_adj unless it is restricted.
            "  restrict_oom_score_adj = true",
            # Pod network namespaces under the node's own state (not /run/netns), unmounted with it.
            "  netns_mounts_under_state_dir = true",
            "  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]",
            "    runtime_type = 'io.containerd.runc.v2'",
            "    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]",
            "      SystemdCgroup = false",
            f"      BinaryName = '{shutil.which('runc') or '/usr/sbin/runc'}'",
            "  [plugins.'io.containerd.cri.v1.runtime'.cni]",
            "    bin_dirs = ['/usr/lib/cni']",
            f"    conf_dir = '{cni_conf}'",
            "[plugins.'io.containerd.cri.v1.images']",
            # Nothing is ever pulled: every image is imported into the k8s.io namespace.
            "  [plugins.'io.containerd.cri.v1.images'.pinned_images]",
            f"    sandbox = '{self.images['PAUSE_IMAGE']}'",
            "",
        ]))
        env = {**os.environ, "PATH": f"{self.bin_dir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}
        self._spawn("containerd", [str(self.bin_dir / "containerd"), f"--config={config}"], env=env)
        wait_for(lambda: self.check_alive() is None and self.containerd_socket.exists() and self.ctr("version"),
                 timeout=60, what="containerd")

    def ctr(self, *args: str) -> str:
        return _run(str(self.bin_dir / "ctr"), f"--address={self.containerd_socket}", "-n", "k8s.io", *args)

    def _import_images(self) -> None:
        directory = Path(self.images["dir"])
        for archive in ("pause.tar", "tether.tar"):
            self.ctr("images", "import", str(directory / archive))

    # --- kubelet ---------------------------------------------------------

    def _make_cgroup_root(self) -> None:
        """A cgroup root per node in every v1 hierarchy, so two nodes on one machine never treat
        each other's pods as orphans."""
        for hierarchy in _CGROUP_V1.iterdir():
            if not (hierarchy / "cgroup.procs").exists() or hierarchy.name == "unified":
                continue
            path = hierarchy / self.cgroup_root.lstrip("/")
            path.mkdir(exist_ok=True)
            if hierarchy.name == "cpuset":
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    (path / knob).write_text((hierarchy / knob).read_text())

    def _start_kubelet(self, kubeconfig: Path, ca: pki.CertPair) -> None:
        root = self.state_dir / "kubelet"
        root.mkdir(exist_ok=True)
        resolv_conf = self.state_dir / "resolv.conf"
        resolv_conf.write_text("# no DNS on the test node\n")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # This machine mounts cgroup v1, which kubelet 1.36 refuses by default.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "failSwapOn": False,
            "podLogsDir": str(self.state_dir / "pod-logs"),
            # The API server reaches the kubelet (logs, exec) with a client certificate of the
            # cluster CA and asks the API server whether that client may.
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(ca.cert)}},
            "authorization": {"mode": "Webhook"},
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "registerWithTaints": [{"key": REAL_NODE_TAINT, "value": "true", "effect": "NoSchedule"}],
            # A test machine's disk may be fuller than a production node's: never evict or collect images.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            # No DNS for pods: the host's resolver is not the project's to send to (and nothing
            # routes there). Everything here goes by address.
            "resolvConf": str(resolv_conf),
        }
        path = self.state_dir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        self._spawn("kubelet", [
            str(self.bin_dir / "kubelet"),
            f"--config={path}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={root}",
            f"--cert-dir={root / 'pki'}",
            f"--node-ip={self.network.node_ip}",
            f"--hostname-override={REAL_NODE_NAME}",
            f"--node-labels={REAL_NODE_LABEL}=true",
            "--v=1",
        ])

    # --- teardown --------------------------------------------------------

    def stop(self) -> None:
        """Stops the kubelet, kills every container of this node, unmounts, removes the network."""
        for name, proc in self._procs:
            if name == "kubelet":
                terminate(proc)
        self._kill_node_processes()
        for _, proc in reversed(self._procs):
            terminate(proc)
        self._procs.clear()
        self._kill_node_processes()
        self._unmount()
        self._remove_cgroup_root()
        self.network.delete()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _kill_node_processes(self) -> None:
        """Containers (in the node's cgroups) and their shims (which name the node's socket)."""
        pids: set[int] = set()
        pids_root = _CGROUP_V1 / "pids" / self.cgroup_root.lstrip("/")
        if pids_root.exists():
            for procs in pids_root.rglob("cgroup.procs"):
                pids |= {int(p) for p in procs.read_text().split()}
        marker = (str(self.run_dir) + "/").encode()  # node 1 must not match node 10's shims
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    if marker in (proc / "cmdline").read_bytes():
                        pids.add(int(proc.name))
                except OSError:
                    continue
        pids.discard(os.getpid())
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _unmount(self) -> None:
        prefixes = (str(self.state_dir) + "/", str(self.run_dir) + "/")
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for target in reversed([m for m in mounts if m.startswith(prefixes)]):
            subprocess.run(["umount", "-l", target], stderr=subprocess.DEVNULL, check=False)

    def _remove_cgroup_root(self) -> None:
        for hierarchy in _CGROUP_V1.iterdir():
            path = hierarchy / self.cgroup_root.lstrip("/")
            if not path.is_dir():
                continue
            for sub in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                try:
                    sub.rmdir()
                except OSError:
                    pass
            try:
                path.rmdir()
            except OSError:
                pass
