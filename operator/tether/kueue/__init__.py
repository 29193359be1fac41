"""Queueing through Kueue, one capability in one package: the typed views of Kueue's objects
(api), the pure decisions (decide, actions), the Workload writes (workloads, book) and their
registration on the controller (capability: CAPABILITY, named in tether/capabilities.py)."""
