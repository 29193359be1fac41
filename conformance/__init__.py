"""Tether's worker conformance kit: see conformance/README.md."""
