"""Model-Spec as the documents define it: each rank declares arch, precision and io_schema at
init; ranks that disagree are refused at the rendezvous, on every rank, naming both."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import mcp_fast as mcp
from _launch import Failure, free_port, ok, run
from mcp_fast.settings import load_model_spec

DOCS: dict[str, Any] = {
    "arch": "GPT-3",
    "precision": "bfloat16",
    "io_schema": {
        "input": ["token_ids:int32[bsz,seq]", "mask:bool[bsz,seq]"],
        "output": ["logits:float16[bsz,seq,vocab]"],
    },
}
DOCS_TEXT = (
    'arch "GPT-3", precision bfloat16, input [token_ids:int32[bsz,seq], mask:bool[bsz,seq]], '
    "output [logits:float16[bsz,seq,vocab]]"
)


def _join(specs: list[Any]) -> list[Any]:
    """Every rank joins with its spec (threads); an MCPError is returned, not raised."""
    port = free_port()

    def rank(r: int) -> Any:
        try:
            with mcp.init(
                rank=r,
                world_size=len(specs),
                master_port=port,
                secret="model-spec",
                timeout=30,
                model_spec=specs[r],
                shm=False,
            ) as g:
                a = np.full(1000, r + 1, np.float32)
                g.all_reduce(a)
                return a
        except mcp.MCPError as e:
            return e

    with ThreadPoolExecutor(len(specs)) as pool:
        return list(pool.map(rank, range(len(specs))))


def test_ranks_that_declare_the_same_model_train_and_aliases_agree() -> None:
    same_in_aliases = {
        "precision": "bf16",
        "arch": "GPT-3",
        "io_schema": {
            "input": ["token_ids : int32[bsz, seq]", "mask:bool[bsz,seq]"],
            "output": ["logits:fp16[bsz,seq,vocab]"],
        },
    }
    out = _join([DOCS, same_in_aliases, DOCS])
    for a in out:
        assert isinstance(a, np.ndarray), a
        np.testing.assert_array_equal(a, np.full(1000, 6, np.float32))


def test_a_rank_with_another_model_is_refused_on_every_rank_naming_both() -> None:
    other = dict(DOCS, io_schema={"input": ["token_ids:int64[bsz,seq]"]})
    out = _join([DOCS, DOCS, other])
    for e in out:
        assert isinstance(e, mcp.SpecMismatchError), e
        msg = str(e)
        assert "rank 2 declares model_spec {" in msg, msg
        assert 'arch "GPT-3", precision bfloat16, input [token_ids:int64[bsz,seq]]}' in msg, msg
        assert f"but rank 0 declares model_spec {{{DOCS_TEXT}}}" in msg, msg


def test_a_rank_that_declares_nothing_among_ranks_that_do_is_refused() -> None:
    out = _join([None, DOCS])
    for e in out:
        assert isinstance(e, mcp.SpecMismatchError), e
        assert "rank 1 declares model_spec {" in str(e) and "rank 0 declares no model_spec" in str(
            e
        )


def test_no_declaration_anywhere_is_no_check() -> None:
    for a in _join([None, None]):
        np.testing.assert_array_equal(a, np.full(1000, 3, np.float32))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"precision": "bf16"}, "arch is missing"),
        ({"arch": "x"}, "precision is missing"),
        ({"arch": "x", "precision": "bf17"}, 'precision "bf17" is not a dtype'),
        ({"arch": "x", "precision": "bf16", "colour": 1}, 'unknown key "colour"'),
        ({"arch": 3, "precision": "bf16"}, "arch must be a string, got int"),
        (
            {"arch": "x", "precision": "bf16", "io_schema": ["ids:int33[b]"]},
            'unknown dtype "int33"',
        ),
        (
            {"arch": "x", "precision": "bf16", "io_schema": ["ids int32[b]"]},
            "is not `name:dtype[dim,...]`",
        ),
        (
            {"arch": "x", "precision": "bf16", "io_schema": {"input": "ids:int32[b]"}},
            "io_schema must be a list",
        ),
        ({"arch": "x", "precision": "bf16", "io_schema": 5}, "io_schema must be a list"),
        ({1: "x"}, "model_spec keys must be strings"),
        (
            {
                "arch": "x",
                "precision": "bf16",
                "io_schema": [f"f{i}:int32[{'d' * 120}]" for i in range(200)],
            },
            "at most 16384",
        ),
    ],
)
def test_bad_declarations_are_value_errors_naming_what_is_wrong(spec: Any, message: str) -> None:
    with pytest.raises(ValueError, match="model_spec") as e:
        mcp.init(rank=0, world_size=1, master_port=free_port(), model_spec=spec)
    assert message in str(e.value), str(e.value)


def test_the_declaration_comes_from_mcp_model_spec_as_json_or_a_file(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MCP_MODEL_SPEC", json.dumps(DOCS))
    assert load_model_spec(None) == DOCS
    f = tmp_path / "spec.toml"
    f.write_text('arch = "GPT-3"\nprecision = "bfloat16"\n[io_schema]\ninput = ["x:int32[b]"]\n')
    monkeypatch.setenv("MCP_MODEL_SPEC", str(f))
    assert load_model_spec(None) == {
        "arch": "GPT-3",
        "precision": "bfloat16",
        "io_schema": {"input": ["x:int32[b]"]},
    }
    assert load_model_spec({"arch": "y"}) == {"arch": "y"}  # an argument wins
    monkeypatch.setenv("MCP_MODEL_SPEC", "{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_model_spec(None)
    monkeypatch.setenv("MCP_MODEL_SPEC", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="cannot be read"):
        load_model_spec(None)


def test_the_torch_backend_refuses_ranks_whose_mcp_model_spec_differs() -> None:
    pytest.importorskip("torch")
    a = json.dumps(DOCS)
    results = ok(run("model_spec_workers.torch_with_spec", 2, [a, a], timeout=120))
    for r in results:
        np.testing.assert_array_equal(r["sum"], np.full(1000, 3.0, "float32"))
    b = json.dumps(dict(DOCS, arch="GPT-2"))
    results = run("model_spec_workers.torch_with_spec", 2, [a, b], timeout=120)
    assert all(isinstance(r, Failure) for r in results), results
    for r in results:
        assert r.type == "SpecMismatchError", r.message
        assert 'rank 1 declares model_spec {arch "GPT-2"' in r.message, r.message
