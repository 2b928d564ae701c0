"""The transport config as the documents write it: every key checked by the core, each one
in effect, files in JSON and TOML, and the precedence arguments > config > environment."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mcp_fast as mcp
from _launch import Failure, free_port, ok, run
from mcp_fast import _core
from mcp_fast.settings import Settings, load_config

DOCS = {
    "max_streams": 4096,
    "fec_group_size": 8,
    "compression": "zstd@L3",
    "heartbeat_interval": 5000,
}


@pytest.fixture(autouse=True)
def _quic_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path's MTU is QUIC's: ranks of this host stay off shared memory."""
    monkeypatch.setenv("MCP_SHM", "0")
    monkeypatch.delenv("MCP_CONFIG", raising=False)
    monkeypatch.delenv("MCP_HEARTBEAT", raising=False)


def _sum_of_inputs(results: list[dict]) -> np.ndarray:
    return sum((r["in"] for r in results[1:]), results[0]["in"])


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"max_stream": 1},
            'unknown transport config key "max_stream"; allowed keys: max_streams, fec_group_size, '
            "compression, heartbeat_interval, mtu",
        ),
        (
            {"max_streams": 0},
            "max_streams=0 is not allowed; max_streams must be an integer from 1 to 1048576",
        ),
        ({"max_streams": True}, "max_streams=a value of type bool is not allowed"),
        ({"fec_group_size": 4096}, "fec_group_size must be an integer from 1 to 1024 shards"),
        (
            {"compression": "zstd@L30"},
            'compression must be "none", "zstd" or "zstd@L<level>" with level 1 to 19',
        ),
        ({"compression": "lz4"}, 'compression="lz4" is not allowed'),
        (
            {"heartbeat_interval": 2.5},
            "heartbeat_interval=a value of type float is not allowed; "
            "heartbeat_interval must be an integer from 10 to 3600000 milliseconds",
        ),
        ({"mtu": 576}, "mtu=576 is not allowed; mtu must be an integer from 1200 to 65000 bytes"),
        ({"mtu": "1440"}, 'mtu="1440" is not allowed'),
        ({1: 2}, "transport config keys must be strings"),
    ],
)
def test_every_bad_key_or_value_is_refused_by_name(config, message) -> None:
    with pytest.raises(ValueError) as e:
        mcp.init(rank=0, world_size=1, master_port=free_port(), config=config)
    assert message in str(e.value)
    # The same check refuses it for the parameter server (before it binds anything).
    with pytest.raises(ValueError) as e:
        _core.PsServer("127.0.0.1:0", b"s" * 32, config=config)
    assert message in str(e.value)


def test_the_documents_config_is_accepted() -> None:
    with mcp.init(rank=0, world_size=1, master_port=free_port(), config=DOCS) as g:
        a = np.arange(10, dtype="float32")
        g.all_reduce(a)
        np.testing.assert_array_equal(a, np.arange(10, dtype="float32"))


def test_json_and_toml_files_and_mcp_config(tmp_path, monkeypatch) -> None:
    j = tmp_path / "mcp.json"
    j.write_text(json.dumps(DOCS))
    t = tmp_path / "mcp.toml"
    t.write_text(
        'max_streams = 4096\nfec_group_size = 8\ncompression = "zstd@L3"\n'
        "heartbeat_interval = 5000\nmtu = 1440\n"
    )
    assert load_config(j) == DOCS
    assert load_config(str(t)) == {**DOCS, "mtu": 1440}
    assert load_config(None) == {}
    monkeypatch.setenv("MCP_CONFIG", str(t))
    assert Settings.resolve().config == {**DOCS, "mtu": 1440}
    # A config given beats MCP_CONFIG.
    assert Settings.resolve(config={"mtu": 1300}).config == {"mtu": 1300}
    bad = tmp_path / "bad.toml"
    bad.write_text("mtu = \n")
    with pytest.raises(ValueError, match=r"bad\.toml' is not valid TOML"):
        load_config(bad)
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a table of keys, got list"):
        load_config(tmp_path / "list.json")
    with pytest.raises(ValueError, match="cannot be read"):
        load_config(tmp_path / "missing.json")
    # A file with a bad key is refused by the core like a dict.
    (tmp_path / "typo.json").write_text('{"mtus": 1440}')
    monkeypatch.setenv("MCP_CONFIG", str(tmp_path / "typo.json"))
    with pytest.raises(ValueError, match='unknown transport config key "mtus"'):
        mcp.init(rank=0, world_size=1, master_port=free_port())


def test_heartbeat_precedence_arguments_then_config_then_environment(monkeypatch) -> None:
    assert Settings.resolve().heartbeat == 5.0
    monkeypatch.setenv("MCP_HEARTBEAT", "3")
    assert Settings.resolve().heartbeat == 3.0
    # The config's heartbeat_interval beats the environment: the core takes it.
    assert Settings.resolve(config={"heartbeat_interval": 200}).heartbeat is None
    # An explicit argument beats the config.
    assert Settings.resolve(heartbeat=1.0, config={"heartbeat_interval": 200}).heartbeat == 1.0


def _silence_limits(results: list[dict]) -> list[float]:
    return [p["silence_limit"] for r in results for p in r["health"] if p["state"] == "connected"]


def test_mtu_compression_and_heartbeat_take_effect() -> None:
    """Rank 0 codes without an entropy stage, rank 1 with zstd level 19: the lossless results
    are still bit-exact (each plane says how it is stored). The MTU is the path's, and the
    heartbeat sets how soon a silent peer is declared lost."""
    configs = [
        {"mtu": 1440, "compression": "none", "heartbeat_interval": 200},
        {"mtu": 1440, "compression": "zstd@L19", "heartbeat_interval": 200},
    ]
    results = ok(run("config_workers.with_config", 2, configs, None, None, timeout=120))
    want = _sum_of_inputs(results)
    for r in results:
        assert r["lossless"].tobytes() == want.tobytes()
        np.testing.assert_array_equal(r["plain"], np.full(2_000_000, 3, "float32"))
        assert [p["mtu"] for p in r["health"] if p["state"] == "connected"] == [1440]
    # 2 heartbeats of 0.2 s plus max(0.05 s, 1.3 x RTT) on loopback, against 10 s and more by
    # default.
    assert all(s < 2.0 for s in _silence_limits(results)), _silence_limits(results)
    # An explicit heartbeat (seconds) beats the config's heartbeat_interval.
    results = ok(run("config_workers.with_config", 2, configs, 2.0, None, timeout=120))
    assert all(4.0 <= s < 8.0 for s in _silence_limits(results)), _silence_limits(results)


def test_without_mtu_the_path_mtu_is_discovered() -> None:
    results = ok(run("config_workers.with_config", 2, [None, None], None, None, timeout=120))
    for r in results:
        # Loopback: discovery climbs far above a container's 1440.
        assert [p["mtu"] > 1500 for p in r["health"] if p["state"] == "connected"] == [True]


def test_one_stream_at_a_time_slows_sends_but_fails_none() -> None:
    """max_streams=1: each frame waits for the one before it to get its verdict."""
    configs = [{"max_streams": 1}, {"max_streams": 1}]
    results = ok(run("config_workers.with_config", 2, configs, None, "stream", timeout=120))
    want = _sum_of_inputs(results)
    for r in results:
        assert r["lossless"].tobytes() == want.tobytes()
        np.testing.assert_array_equal(r["plain"], np.full(2_000_000, 3, "float32"))


def test_fec_group_size_reaches_the_fec_lane() -> None:
    """A small block on the forced FEC lane: the frames still arrive exact."""
    configs = [{"fec_group_size": 8}, {"fec_group_size": 8}]
    results = ok(run("config_workers.with_config", 2, configs, None, "fec", timeout=120))
    want = _sum_of_inputs(results)
    for r in results:
        assert r["lossless"].tobytes() == want.tobytes()
        assert r["lane_stats"]["frames_sent"] > 0


def test_ranks_that_disagree_on_the_codec_fail_with_both_specs() -> None:
    """compression tunes the lossless codec; the codec itself is in every frame's spec."""
    configs = [{"compression": "zstd@L3"}, {"compression": "none"}]
    results = run("config_workers.codec_per_rank", 2, ["lossless", "none"], configs, timeout=60)
    assert all(isinstance(f, Failure) for f in results), results
    for f in results:
        assert f.type == "SpecMismatchError", f.message
        assert "codec=lossless" in f.message, f.message


def test_the_torch_backend_takes_pg_options_or_mcp_config(tmp_path) -> None:
    pytest.importorskip("torch")
    results = ok(run("config_workers.torch_with_config", 2, {"mtu": 1440}, timeout=120))
    for r in results:
        np.testing.assert_array_equal(r["sum"], np.full(100_000, 3.0, "float32"))
        assert r["mtu"] == [1440]
    f = tmp_path / "mcp.toml"
    f.write_text('mtu = 1300\ncompression = "zstd@L3"\n')
    env = {"MCP_CONFIG": str(f)}
    results = ok(run("config_workers.torch_with_config", 2, None, timeout=120, env=env))
    assert [r["mtu"] for r in results] == [[1300], [1300]]
    (tmp_path / "typo.json").write_text('{"mtu": 1300, "mtus": 1}')
    env = {"MCP_CONFIG": str(tmp_path / "typo.json")}
    results = run("config_workers.torch_with_config", 2, None, timeout=120, env=env)
    assert all(isinstance(r, Failure) for r in results), results
    for r in results:
        assert r.type == "ValueError", r.message
        assert 'unknown transport config key "mtus"' in r.message, r.message


@pytest.mark.parametrize("world", [2, 3])
def test_a_setting_only_rank_zero_refuses_reaches_every_rank_in_torch(world) -> None:
    """Rank 0 hosts torch's store: it waits for the others to read its error before it
    raises, so that they raise it too rather than lose the store under them."""
    pytest.importorskip("torch")
    results = run("config_workers.torch_rank0_refuses", world, timeout=120)
    assert all(isinstance(r, Failure) for r in results), results
    for rank, r in enumerate(results):
        assert r.type == "ValueError", r.message
        assert "lane must be 'auto', 'stream' or 'fec', got \"fast\"" in r.message, r.message
        assert ("rank 0 could not start the mcp backend" in r.message) == (rank > 0), r.message


def test_the_parameter_server_takes_the_config() -> None:
    """One stream per connection and a container's MTU: concurrent pushes wait for the stream,
    none fails, and the sums are exact."""
    from concurrent.futures import ThreadPoolExecutor

    from mcp_fast import ps

    cfg = {"max_streams": 1, "mtu": 1300, "heartbeat_interval": 100, "compression": "zstd@L3"}
    a = f"127.0.0.1:{free_port()}"
    srv = ps.Server(a, secret="cfg-secret", lr=1.0, momentum=0.0, aggregate="sum", config=cfg)
    try:
        with ps.Worker([a], 0, secret="cfg-secret", timeout=30, config=cfg) as w:
            w.init({f"k{j}": np.zeros(50_000, np.float32) for j in range(4)})
            with ThreadPoolExecutor(4) as pool:
                list(
                    pool.map(
                        lambda j: w.push({f"k{j}": np.full(50_000, j + 1.0, np.float32)}), range(4)
                    )
                )
            w.step()
            out = w.pull()
        for j in range(4):
            np.testing.assert_array_equal(out[f"k{j}"], np.full(50_000, -(j + 1.0), np.float32))
    finally:
        srv.close()
    with pytest.raises(ValueError, match='unknown transport config key "mtus"'):
        ps.Worker([a], 0, secret="cfg-secret", config={"mtus": 1})
