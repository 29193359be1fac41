"""Tether: a Kubernetes control plane for long-running worker jobs."""

__version__ = "0.1.0"
