"""One settings reader for every kind of group: arguments first, then MCP_*, then defaults."""

from __future__ import annotations

import pytest

from mcp_fast.settings import Settings


def test_arguments_beat_the_environment_which_beats_the_defaults(monkeypatch) -> None:
    for k in ("MCP_SECRET", "MCP_TIMEOUT", "MCP_CONNECT_TIMEOUT", "MCP_LANE", "MCP_CHAOS"):
        monkeypatch.delenv(k, raising=False)
    d = Settings.resolve()
    assert (d.secret, d.timeout, d.connect_timeout, d.lane, d.chaos) == (
        None,
        300.0,
        300.0,
        "auto",
        None,
    )
    assert (d.resend_limit, d.stall_timeout, d.allow_generated_secret) == (8, 60.0, False)
    monkeypatch.setenv("MCP_TIMEOUT", "20")
    monkeypatch.setenv("MCP_LANE", "fec")
    monkeypatch.setenv("MCP_CHAOS", "loss=0.1")
    monkeypatch.setenv("MCP_SECRET", "s3")
    e = Settings.resolve()
    assert (e.timeout, e.connect_timeout, e.lane, e.chaos, e.secret) == (
        20.0,
        20.0,
        "fec",
        "loss=0.1",
        b"s3",
    )
    a = Settings.resolve(timeout=5, lane="stream", secret=b"x", resend_limit=2)
    assert (a.timeout, a.lane, a.secret, a.resend_limit) == (5.0, "stream", b"x", 2)
    assert a.core_kwargs()["resend_limit"] == 2 and a.core_kwargs()["lane"] == "stream"


@pytest.mark.parametrize(
    ("name", "value", "what"),
    [("MCP_TIMEOUT", "soon", "a number"), ("MCP_RESEND_LIMIT", "8.5", "an integer")],
)
def test_a_bad_environment_value_names_the_variable(monkeypatch, name, value, what) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}' is not {what}"):
        Settings.resolve()
