"""`figures_table`: the benchmarks' figures as one JSON object or as a table."""

from __future__ import annotations

import json

import pytest

from kvfsm.cli.render import figures_table

_FIGURES = {"rtt_us_p50_peer": 17.4321, "detected": True, "samples": 2000}


def test_json_prints_one_object_with_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    figures_table("t", _FIGURES, as_json=True)
    assert json.loads(capsys.readouterr().out) == _FIGURES


def test_the_table_has_a_row_per_figure(capsys: pytest.CaptureFixture[str]) -> None:
    figures_table("notifications", _FIGURES)
    out = capsys.readouterr().out
    assert "notifications" in out
    assert all(key in out for key in _FIGURES)
    assert "17.43" in out and "True" in out and "2000" in out
