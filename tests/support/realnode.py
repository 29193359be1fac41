"""The test side of the cluster's real node (tether.devcluster.realnode): where it is, its images,
how to cut one pod's network, and how to reach its containers the way a node operator would."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Any

from tether.devcluster.realnode import NodeNetwork, real_node_placement


@dataclass(frozen=True)
class RealNodeHandle:
    network: NodeNetwork
    containerd_socket: str
    ctr_path: str
    images: dict[str, str]

    @classmethod
    def from_description(cls, described: dict[str, Any]) -> "RealNodeHandle":
        return cls(NodeNetwork(int(described["index"])), described["containerdSocket"], described["ctr"],
                   described["images"])

    @property
    def host_ip(self) -> str:
        """The host side of the node's veth: what pods reach the test's own servers at."""
        return self.network.host_ip

    @property
    def tether_image(self) -> tuple[str, str]:
        """(repository, tag) of the image built from this checkout's Dockerfile."""
        repository, _, tag = self.images["TETHER_IMAGE"].rpartition(":")
        return repository, tag

    @staticmethod
    def placement() -> dict[str, object]:
        return real_node_placement()

    def place(self, body: dict[str, Any]) -> dict[str, Any]:
        """A WorkerRun whose worker pods go to the real node."""
        body["spec"]["template"]["spec"].update(real_node_placement())
        return body

    def ctr(self, *args: str) -> str:
        return subprocess.run([self.ctr_path, f"--address={self.containerd_socket}", "-n", "k8s.io", *args],
                              check=True, capture_output=True, text=True).stdout

    def kill_container(self, container_id: str) -> None:
        """SIGKILL a container's process, as the OOM killer or a crash would (the kubelet restarts it)."""
        self.ctr("tasks", "kill", "--signal", "SIGKILL", container_id.removeprefix("containerd://"))
