"""The operator's command line: settings that bound what a run's status holds are checked as parsed."""

from __future__ import annotations

import pytest

from tether import cli


def test_attempt_history_defaults_to_the_crds_bound_and_is_refused_outside_it(monkeypatch: pytest.MonkeyPatch,
                                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.build_parser().parse_args(["operator"]).attempt_history == 100
    assert cli.build_parser().parse_args(["operator", "--attempt-history", "3"]).attempt_history == 3
    monkeypatch.setenv("TETHER_ATTEMPT_HISTORY", "7")  # what the chart's attemptHistory sets
    assert cli.build_parser().parse_args(["operator"]).attempt_history == 7
    for bad in ("0", "101"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["operator", "--attempt-history", bad])
        assert "must be 1 to 100" in capsys.readouterr().err
    monkeypatch.setenv("TETHER_ATTEMPT_HISTORY", "0")  # a usage error of the operator command, not of all
    assert cli.build_parser().parse_args(["dev", "cluster"]).command == "dev"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["operator"])
    assert "--attempt-history: must be 1 to 100, not 0" in capsys.readouterr().err
