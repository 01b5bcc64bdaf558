"""Routing traces in and out (experiments.run.routing): trace files read, checked and exported;
end to end, a modeled run driven by a vLLM-format array routes exactly what it holds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from experiments.run.routing import ROUTING_FILE, export_trace, load_trace, request_offsets
from tests.helpers import moemesh, moemesh_process


def vllm_like(tokens: int, layers: int, experts: int, top_k: int, seed: int) -> np.ndarray:
    """A routed-experts array as vLLM returns it: [tokens, layers, top_k], distinct per row."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, layers, experts)), axis=-1)[..., :top_k]


def test_a_npy_trace_is_read_and_checked_against_the_model(tmp_path: Path) -> None:
    arr = vllm_like(12, 4, 16, 2, 0)
    np.save(tmp_path / "t.npy", arr.astype(np.int32))
    trace = load_trace(tmp_path / "t.npy")
    assert trace.fmt == "npy" and trace.weights is None and np.array_equal(trace.experts, arr)
    trace.check(4, 16, 2, "tiny-moe")
    # a request's slice goes round at the end of the stream
    assert trace.take(10, 4)["experts"] == arr[[10, 11, 0, 1]].tolist()
    with pytest.raises(ValueError, match="3 layers, top-2"):
        trace.check(3, 16, 2, "m")
    with pytest.raises(ValueError, match=r"outside 0\.\.7"):
        trace.check(4, 8, 2, "m")
    twice = arr.copy()
    twice[5, 1] = [3, 3]
    np.save(tmp_path / "twice.npy", twice)
    with pytest.raises(ValueError, match="token 5, layer 1 picks the same expert twice"):
        load_trace(tmp_path / "twice.npy").check(4, 16, 2, "m")


@pytest.mark.parametrize(("name", "content", "says"), [
    ("flat.npy", np.zeros((4, 2)), "want [tokens, layers, top_k]"),
    ("float.npy", np.zeros((4, 2, 2)), "must be integers"),
    ("t.csv", None, "unknown trace format"),
    ("gone.npy", None, "file not found"),
    ("bin.jsonl", b"\xff\xfe{}", "not UTF-8 text"),
    ("a.jsonl", '{"request": 0, "token": 0}\n', ":1: field 'experts' is missing"),
    ("b.jsonl", '{"request": 0, "token": 0, "experts": [[1, 2]]}\nnot json\n', ":2: not JSON"),
    ("c.jsonl", '{"request": "x", "token": 0, "experts": [[1, 2]]}\n', "'request' must be"),
    ("d.jsonl", '{"request": 0, "token": 0, "experts": [[1, 2]]}\n'
                '{"request": 0, "token": 1, "experts": [[1]]}\n', "field 'experts' must be"),
    ("e.jsonl", '{"request": 0, "token": 0, "experts": [[1, 2]], "policy": "a"}\n'
                '{"request": 0, "token": 1, "experts": [[1, 2]], "policy": "b"}\n',
     "several policies (a, b)"),
    ("nan.jsonl", '{"request": 0, "token": 0, "experts": [[1, 2]], "weights": [[0.5, 0.5]]}\n'
                  '{"request": 0, "token": 1, "experts": [[1, 2]], "weights": [[NaN, 0.5]]}\n',
     ":2: field 'weights'[0][0] is nan: gate weights must be finite"),
    ("inf.jsonl", '{"request": 0, "token": 0, "experts": [[1, 2]], '
                  '"weights": [[0.5, Infinity]]}\n', ":1: field 'weights'[0][1] is inf"),
])
def test_bad_trace_files_name_the_file_and_field(tmp_path: Path, name: str, content: object,
                                                 says: str) -> None:
    path = tmp_path / name
    if isinstance(content, np.ndarray):
        np.save(path, content)
    elif isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif name.endswith(".csv"):
        path.write_text("x")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as err:
        load_trace(path)
    assert says in str(err.value)


def test_a_trace_file_is_bounded_before_it_is_read(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38: a device, a folder or a file above the cap is refused by name, unopened."""
    import experiments.run.routing as routing

    fifo = tmp_path / "pipe.npy"
    os.mkfifo(fifo)  # opening it would block
    for path, says in ((fifo, "not a regular file"), (tmp_path, "unknown trace format")):
        with pytest.raises(ValueError, match=says):
            load_trace(path)
    (tmp_path / "dir.npy").mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        load_trace(tmp_path / "dir.npy")
    big = tmp_path / "big.npy"
    np.save(big, np.zeros((64, 4, 2), dtype=np.int64))
    monkeypatch.setattr(routing, "MAX_TRACE_BYTES", 1024)
    with pytest.raises(ValueError, match=r"big\.npy: .* more than the 1,024 a routing trace"):
        load_trace(big)


def _run_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    lines = [{"policy": p, "rep": 0, "request": r, "home": "edge1",
              "experts": [[[r, t + 1]] for t in range(3)],
              "weights": [[[0.75, 0.25]] for _ in range(3)]}
             for p in ("greedy", "hetroute") for r in (1, 0)]
    (folder / ROUTING_FILE).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder


def test_export_writes_one_arm_as_jsonl_or_npy_and_reads_back(tmp_path: Path) -> None:
    folder = _run_folder(tmp_path)
    assert export_trace(folder, tmp_path / "h.jsonl", "hetroute") == 6
    back = load_trace(tmp_path / "h.jsonl")
    # requests in id order, positions in order; weights kept
    assert back.experts[:, 0].tolist() == [[0, 1], [0, 2], [0, 3], [1, 1], [1, 2], [1, 3]]
    assert back.weights is not None and np.allclose(back.weights[..., 0], 0.75)
    assert export_trace(folder, tmp_path / "g.npy") == 6  # the first arm by default
    assert np.array_equal(np.load(tmp_path / "g.npy"), back.experts)
    with pytest.raises(ValueError, match="no routing for policy 'exact'; it has greedy, "
                                         "hetroute"):
        export_trace(folder, tmp_path / "x.jsonl", "exact")
    with pytest.raises(ValueError, match=r"write \.jsonl"):
        export_trace(folder, tmp_path / "x.txt")
    with pytest.raises(ValueError, match=r"no routing\.jsonl here"):
        export_trace(tmp_path, tmp_path / "x.jsonl")


def test_trace_export_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _run_folder(tmp_path)
    assert moemesh("trace", "export", str(folder), "--policy", "greedy") == 0
    assert "6 positions" in capsys.readouterr().out
    assert (folder / "trace.jsonl").is_file()
    assert moemesh("trace", "export", str(tmp_path / "nowhere")) == 2
    assert "nowhere" in capsys.readouterr().err


def test_a_trace_is_refused_for_real_weights_and_checked_against_the_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.helpers import ROOT

    np.save(tmp_path / "t.npy", vllm_like(8, 4, 16, 2, 1))
    quickstart = ROOT / "experiments" / "scenarios" / "quickstart.yaml"
    assert moemesh("run", str(quickstart), "--trace", str(tmp_path / "t.npy")) == 2
    assert "only a modeled run routes by a trace" in capsys.readouterr().err
    (tmp_path / "traced.yaml").write_text(MODELED)
    np.save(tmp_path / "wide.npy", vllm_like(8, 4, 16, 3, 1))  # tiny-moe is top-2
    assert moemesh("run", str(tmp_path / "traced.yaml"), "--trace",
                   str(tmp_path / "wide.npy")) == 2
    assert "wide.npy: routes [tokens, 4 layers, top-3]" in capsys.readouterr().err


def deepseek_vllm_array(tokens: int, seed: int) -> np.ndarray:
    """deepseek-moe-16b as vLLM returns it: 28 decoder layers, layer 0 dense (first_k_dense_
    replace 1) and so all zeros (the capturer's zero-filled buffer), 27 MoE layers of top-6
    of 64."""
    from moe.profiles import get

    prof = get("deepseek-moe-16b")
    arr = vllm_like(tokens, prof.dense_layers + prof.layers, prof.experts, prof.top_k, seed)
    arr[:, :prof.leading_dense_layers] = 0
    return arr.astype(np.int32)


def test_vllm_rows_of_leading_dense_layers_are_dropped_and_said(tmp_path: Path) -> None:
    from moe.profiles import get

    prof = get("deepseek-moe-16b")
    arr = deepseek_vllm_array(10, 2)
    np.save(tmp_path / "ds.npy", arr)
    trace = load_trace(tmp_path / "ds.npy")
    with pytest.raises(ValueError, match="28 layers, top-6], the model deepseek-moe-16b has 27"):
        trace.check(prof.layers, prof.experts, prof.top_k, prof.name)
    fitted, said = trace.fit_layers(prof.layers, prof.dense_layers, prof.leading_dense_layers,
                                    prof.name)
    assert said == (f"{tmp_path / 'ds.npy'}: 28 layers: dropped the first 1 (dense in "
                    f"deepseek-moe-16b, zeros in vLLM's array), kept 27 MoE layers")
    fitted.check(prof.layers, prof.experts, prof.top_k, prof.name)
    assert np.array_equal(fitted.experts, arr[:, 1:])
    assert fitted.describe()["layers"] == 27 and fitted.describe()["dropped_dense_layers"] == 1
    # an array of the MoE layers only is kept as it is
    assert fitted.fit_layers(27, 1, 1, prof.name) == (fitted, None)
    routed = arr.copy()
    routed[3, 0] = [0, 1, 2, 3, 4, 5]  # a "dense" layer that routes: not vLLM's layout
    with pytest.raises(ValueError, match=r"dense layer 0 routes token 3 to \[0, 1, 2, 3, 4, 5\]"):
        load_trace(_saved(tmp_path / "r.npy", routed)).fit_layers(27, 1, 1, prof.name)
    # Switch's dense layers alternate: which rows are dense is not known here
    with pytest.raises(ValueError, match="dense layers do not all come first"):
        load_trace(_saved(tmp_path / "s.npy", vllm_like(4, 24, 8, 1, 0))).fit_layers(
            12, 12, 0, "switch-base-8")


def _saved(path: Path, arr: np.ndarray) -> Path:
    np.save(path, arr)
    return path


def test_request_offsets_follow_request_ids() -> None:
    assert request_offsets([(2, 5), (0, 3), (1, 4)]) == {0: 0, 1: 3, 2: 7}


MODELED = """
name: traced
topology:
  nodes:
    - {name: edge1, profile: tiny-edge, users: 2}
    - {name: edge2, profile: tiny-edge, users: 1}
  defaults: {delay_ms: 1ms, rate_mbit: 500mbit}
model: {name: tiny-moe, mode: modeled}
runtime: local
shaper: app
placement: {policy: hetroute, redundancy: 2.0}
policies: [greedy]
workload: {arrival: poisson, rate_rps: 4, prompt_tokens: [3, 6], gen_tokens: 3,
           requests: 5, seed: 4}
"""


@pytest.mark.slow
def test_a_modeled_run_routes_a_vllm_trace_exactly(tmp_path: Path) -> None:
    from moe.profiles import get

    prof = get("tiny-moe")
    arr = vllm_like(64, prof.layers, prof.experts, prof.top_k, 9)
    np.save(tmp_path / "routed_experts.npy", arr)
    (tmp_path / "traced.yaml").write_text(MODELED)
    out = tmp_path / "out"
    done = moemesh_process("run", str(tmp_path / "traced.yaml"), "--trace",
                           str(tmp_path / "routed_experts.npy"), "--quality-windows", "0",
                           "--tdf", "2", "--quiet", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((out / "run.json").read_text())["trace"]["format"] == "npy"
    done = moemesh_process("trace", "export", str(out), "--out", str(tmp_path / "back.npy"))
    assert done.returncode == 0, done.stderr
    back = np.load(tmp_path / "back.npy")
    # 5 requests of 3..6 prompt positions + 2 fed-back tokens: fewer than 64 positions, so
    # the exported stream is the input's first positions, exactly
    assert 5 * (3 + 2) <= len(back) <= 5 * (6 + 2)
    assert np.array_equal(back, arr[:len(back)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policies"]["greedy"]["tokens"] == 15  # every token completed


DEEPSEEK = """
name: ds-traced
topology:
  nodes:
    - {name: edge1, profile: a100, users: 2}
    - {name: edge2, profile: a100, users: 1}
  defaults: {delay_ms: 1ms, rate_mbit: 1gbit}
model: {name: deepseek-moe-16b, mode: modeled}
runtime: local
shaper: app
clock: virtual
placement: {policy: hetroute, redundancy: 2.0}
policies: [greedy]
workload: {arrival: poisson, rate_rps: 4, prompt_tokens: [3, 6], gen_tokens: 3,
           requests: 4, seed: 4}
"""


@pytest.mark.slow
def test_a_28_layer_deepseek_vllm_array_runs_through_moemesh_run(tmp_path: Path) -> None:
    """Issue 25 item 5 (b): vLLM's deepseek-moe-16b array (28 layers, the first dense) runs
    through `moemesh run --trace`, which says it dropped 1 layer and routes the other 27
    exactly (about 40 s here)."""
    arr = deepseek_vllm_array(64, 9)
    np.save(tmp_path / "routed_experts.npy", arr)
    (tmp_path / "ds.yaml").write_text(DEEPSEEK)
    out = tmp_path / "out"
    done = moemesh_process("run", str(tmp_path / "ds.yaml"), "--trace",
                           str(tmp_path / "routed_experts.npy"), "--quality-windows", "0",
                           "--quiet", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "28 layers: dropped the first 1 (dense in deepseek-moe-16b" in done.stderr
    described = json.loads((out / "run.json").read_text())["trace"]
    assert (described["layers"], described["dropped_dense_layers"]) == (27, 1)
    done = moemesh_process("trace", "export", str(out), "--out", str(tmp_path / "back.npy"))
    assert done.returncode == 0, done.stderr
    back = np.load(tmp_path / "back.npy")
    assert back.shape[1:] == (27, 6) and np.array_equal(back, arr[:len(back), 1:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policies"]["greedy"]["tokens"] == 12  # 4 requests x 3, all completed
