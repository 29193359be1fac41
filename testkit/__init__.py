"""The engines the tests, the conformance kit (conformance/) and the benchmarks (benchmarks/) share:
the test client of the API server, the operator as a killable process, the fault-injecting API
proxy, the fault trials and their oracle over the audit log, the receivers and run scenarios.
Test-only helpers stay in tests/support."""
