"""`moemesh bench engine`: one tiny-moe decode token in process, through a mesh, and the floor.

Four figures from one run on this host, measured in alternating rounds (the first a warm-up)
so that drift from other work on a shared host hits them alike:

* **inprocess_ms**: `model.forward` of one token with a KV cache (tiny-moe, one torch thread,
  no grad), per decode step of a greedy generation: prompt `PROMPT` prefilled (not timed),
  then `tokens - 1` steps, each timed alone.
* **mesh_local_ms**: the same generation (prompt, length, greedy) through `POST /v1/generate`
  of a one-node mesh: a `moemesh node` process (`python -m orchestrator.cli node`, router
  mounted) holding every expert in its GPU tier, on a device profile so fast that nothing
  emulated is added (1e9 TFLOP/s, 1e6 GB/s). Per decode token: the `latency_ms` of the
  answer's records 1.. (record 0 is the prefill). Nothing subtracted.
* **mesh_remote_ms**: the extra cost of one remote hop. The same generation from a second
  node `h` that holds no expert, in a two-node mesh with zero-delay links (the app shaper,
  0 ms, 400 Gbit/s each way) whose other node is the one above: every layer of every token
  sends one request to it. (mean remote token − mean local token) / hops per token, where a
  hop is one request to another node (counted from the records: per layer, the nodes other
  than the home it used; 4 per token for tiny-moe).
* **echo_ms**: the aiohttp floor: round trip of a POST of the body one such hop sends (the
  token's two experts, one f32 row each, msgpack) to a trivial aiohttp handler in another
  process on loopback that answers with as many bytes as the node does (`python -m bench.node
  echo`), one at a time over a reused session.

`ratios` relate them: mesh_local_vs_inprocess (target ≤ 1.5) and remote_hop_vs_echo (target
≤ 1.5). Medians and p90s go beside the means (for the hop: the same difference of the token
quantiles), with sample counts; `same_tokens` says whether the mesh generated what the
in-process model did.

    python -m bench.engine [--json] [--rounds N] [--tokens N]      (also: moemesh bench engine)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moe.vocab import FULL_PRECISION, PlacementEntry

__all__ = ["TARGETS", "add_arguments", "command", "main", "run_bench", "summarize"]

PROMPT = "def fibonacci(n):\n    "
TARGETS = {"mesh_local_vs_inprocess": 1.5, "remote_hop_vs_echo": 1.5}
FAST_PROFILE = {"gpu_tflops": 1e9, "gpu_mem_gb": 1e4, "cpu_mem_gb": 1e4, "h2d_gbps": 1e6}
ZERO_LINK = {"delay_ms": 0.0, "rate_mbit": 400_000.0}
ROOT = Path(__file__).resolve().parents[1]


# -- figures ----------------------------------------------------------------------------------
def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _stats(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        raise ValueError("no samples")
    return {"mean_ms": round(statistics.fmean(values), 4),
            "median_ms": round(statistics.median(values), 4),
            "p90_ms": round(_pct(values, 0.9), 4), "n": len(values)}


def summarize(inprocess: Sequence[float], local: Sequence[float], remote: Sequence[float],
              echo: Sequence[float], hops_per_token: float) -> dict[str, Any]:
    """The figures and ratios from the samples (ms): in-process steps, local and remote mesh
    decode tokens, echo round trips; `hops_per_token` remote requests per remote token."""
    if not hops_per_token > 0:
        raise ValueError(f"the remote mesh made no remote request (hops per token "
                         f"{hops_per_token}): its home node must hold no expert")
    st = {"inprocess": _stats(inprocess), "mesh_local": _stats(local),
          "mesh_remote_token": _stats(remote), "echo": _stats(echo)}
    st["mesh_remote_hop"] = {
        k: round((st["mesh_remote_token"][k] - st["mesh_local"][k]) / hops_per_token, 4)
        for k in ("mean_ms", "median_ms", "p90_ms")
    } | {"n": len(remote)}
    fig = {"inprocess_ms": st["inprocess"]["mean_ms"], "mesh_local_ms": st["mesh_local"]["mean_ms"],
           "mesh_remote_ms": st["mesh_remote_hop"]["mean_ms"], "echo_ms": st["echo"]["mean_ms"]}
    ratios = {
        "mesh_local_vs_inprocess": fig["mesh_local_ms"] / fig["inprocess_ms"],
        "remote_hop_vs_echo": fig["mesh_remote_ms"] / fig["echo_ms"],
        "mesh_local_vs_inprocess_median": (st["mesh_local"]["median_ms"]
                                           / st["inprocess"]["median_ms"]),
        "remote_hop_vs_echo_median": st["mesh_remote_hop"]["median_ms"] / st["echo"]["median_ms"],
        "mesh_remote_token_vs_inprocess": (st["mesh_remote_token"]["mean_ms"]
                                           / fig["inprocess_ms"]),
    }
    return {**fig, "ratios": {k: round(v, 3) for k, v in ratios.items()}, "stats": st,
            "hops_per_token": round(hops_per_token, 3), "targets": dict(TARGETS),
            "targets_met": {k: ratios[k] <= v for k, v in TARGETS.items()}}


# -- in process -------------------------------------------------------------------------------
def _inprocess(model: Any, prompt: list[int], tokens: int) -> tuple[list[float], list[int]]:
    """Greedy: prefill, then `tokens - 1` one-token forwards with the cache, each timed."""
    import torch

    from moe import KVCache

    out, steps = [], []
    cache = KVCache()
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache)
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        for _ in range(tokens - 1):
            inp = torch.tensor([[nxt]])
            t0 = time.perf_counter()
            logits = model(inp, cache=cache)
            steps.append((time.perf_counter() - t0) * 1e3)
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
    return steps, out


# -- through the mesh -------------------------------------------------------------------------
async def _generate(session: Any, url: str, prompt: str, tokens: int, policy: str,
                    home: str) -> tuple[list[float], list[int], list[int]]:
    """One POST /v1/generate: (decode tokens' latencies, their hops, the generated tokens)."""
    body = {"prompt": prompt, "max_tokens": tokens, "policy": policy, "records": True}
    async with session.post(url + "/v1/generate", json=body) as resp:
        answer = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{url}/v1/generate answered {resp.status}: {answer}")
    if answer.get("failed") or len(answer["records"]) != tokens:
        raise RuntimeError(f"the generation at {url} failed: {answer.get('failed')!r} after "
                           f"{len(answer['records'])} of {tokens} tokens")
    lat, hops = [], []
    for rec in answer["records"][1:]:  # record 0: the prefill
        lat.append(float(rec["latency_ms"]))
        hops.append(sum(n != home for layer in rec["layers"] for n in layer["nodes"]))
    return lat, hops, list(answer["tokens"])


def _experts(shape: Any) -> list[dict[str, Any]]:
    return [PlacementEntry(layer, e, FULL_PRECISION, "gpu").to_json()
            for layer in range(shape.layers) for e in range(shape.experts)]


async def _start(tmp: Path, model: str, env: dict[str, str],
                 procs: list[Any]) -> tuple[str, str, str]:
    """Node p (every expert), node h (none), the echo server: their URLs."""
    from bench.node import _spawn

    prof = tmp / "fast-device.json"
    prof.write_text(json.dumps({"name": "bench-fast", **FAST_PROFILE}))

    def node(name: str, placement: str) -> list[str]:
        return ["-m", "orchestrator.cli", "node", "--name", name, "--port", "0", "--model",
                model, "--compute", "real", "--profile", str(prof), "--placement", placement]

    started = await asyncio.gather(
        _spawn(node("p", "all-gpu"), env), _spawn(node("h", "none"), env),
        _spawn(["-m", "bench.node", "echo", "--port", "0"], env), return_exceptions=True)
    procs += [s[0] for s in started if not isinstance(s, BaseException)]
    for s in started:
        if isinstance(s, BaseException):
            raise s
    (_, p_url), (_, h_url), (_, echo_url) = started
    return p_url, h_url, echo_url


async def _configure(token: str, p_url: str, h_url: str, every: list[dict]) -> None:
    """p alone is the one-node mesh; h's mesh is {h, p} with zero-delay links, experts on p."""
    from services import ClientSettings, NodeClient

    links = {"h": {"p": ZERO_LINK}, "p": {"h": ZERO_LINK}}
    urls = {"h": h_url, "p": p_url}
    async with NodeClient(ClientSettings(token=token)) as client:
        await client.put_mesh(p_url, {"nodes": {"p": {"url": p_url, "profile": FAST_PROFILE}},
                                      "links": {}, "placement": {"p": every}})
        await asyncio.gather(*(client.put_links(u, links[n], backend="app")
                               for n, u in urls.items()))
        await client.put_mesh(h_url, {
            "nodes": {n: {"url": u, "profile": FAST_PROFILE} for n, u in urls.items()},
            "links": links, "placement": {"h": [], "p": every}})


async def run_bench(rounds: int = 5, tokens: int = 48, generations: int = 3, echoes: int = 300,
                    policy: str = "hetroute", model: str = "tiny-moe") -> dict[str, Any]:
    """Start the nodes and the echo server, measure in alternating rounds, summarize."""
    import aiohttp
    import torch

    import moe
    from bench.node import REPLY_HEADER, _post, _stop
    from router.settings import Settings
    from services.wire import CONTENT_TYPE, make_group, pack_request

    if rounds < 1 or tokens < 2 or generations < 1 or echoes < 1:
        raise ValueError("need rounds >= 1, tokens >= 2, generations >= 1, echoes >= 1")
    torch.set_num_threads(1)  # as a node computes
    lm = moe.load(model)
    shape = lm.config
    prompt = list(PROMPT.encode())
    wire = Settings().wire_dtype
    token = secrets.token_hex(8)
    env = dict(os.environ, MOEMESH_TOKEN=token)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs: list[asyncio.subprocess.Process] = []
    samples: dict[str, list[float]] = {"inprocess": [], "local": [], "remote": [], "echo": []}
    hops: list[int] = []
    same = True
    try:
        with tempfile.TemporaryDirectory(prefix="moemesh-bench-engine-") as tmp:
            p_url, h_url, echo_url = await _start(Path(tmp), model, env, procs)
            await _configure(token, p_url, h_url, _experts(shape))
            x = torch.randn(1, shape.d_model, generator=torch.Generator().manual_seed(0))
            hop_body = pack_request([make_group(  # one token, its top-k on one node
                0, x, [[(e, FULL_PRECISION, 1 / shape.top_k) for e in range(shape.top_k)]], wire)],
                req="bench")
            headers = {"Content-Type": CONTENT_TYPE}
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as session:
                async with session.post(p_url + "/v1/forward", data=hop_body,
                                        headers=headers) as resp:
                    reply = len(await resp.read())
                    if resp.status != 200:
                        raise RuntimeError(f"{p_url}/v1/forward answered {resp.status}")
                echo = _post(session, echo_url + "/v1/forward", hop_body,
                             {**headers, REPLY_HEADER: str(reply)})
                for r in range(rounds + 1):  # round 0: warm-up
                    keep = r > 0
                    gc.collect()
                    for _ in range(generations):
                        steps, want = _inprocess(lm, prompt, tokens)
                        if keep:
                            samples["inprocess"] += steps
                    for target, url, home in (("local", p_url, "p"), ("remote", h_url, "h")):
                        for _ in range(generations):
                            lat, hop, got = await _generate(session, url, PROMPT, tokens,
                                                            policy, home)
                            same = same and got == want
                            if keep:
                                samples[target] += lat
                                hops += hop if target == "remote" else []
                    for _ in range(echoes):
                        t0 = time.perf_counter()
                        await echo()
                        if keep:
                            samples["echo"].append((time.perf_counter() - t0) * 1e3)
    finally:
        await asyncio.gather(*(_stop(p) for p in procs))
    out = summarize(samples["inprocess"], samples["local"], samples["remote"], samples["echo"],
                    sum(hops) / len(hops) if hops else 0.0)
    out["same_tokens"] = same
    out["setup"] = {"model": model, "prompt": PROMPT, "tokens": tokens, "rounds": rounds,
                    "generations_per_round": generations, "echoes_per_round": echoes,
                    "policy": policy, "wire_dtype": wire, "hop_body_bytes": len(hop_body),
                    "hop_reply_bytes": reply, "torch_threads": torch.get_num_threads()}
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    out["cpus"] = os.cpu_count()
    return out


# -- output -----------------------------------------------------------------------------------
def _table(res: dict[str, Any]) -> str:
    s, st, r = res["setup"], res["stats"], res["ratios"]
    lines = [f"moemesh bench engine: {s['model']}, {s['tokens']}-token greedy generations "
             f"({s['policy']}), {s['rounds']} rounds, load avg {res['load_avg_1m']} on "
             f"{res['cpus']} CPUs",
             f"{'figure':34s} {'mean ms':>9s} {'median':>9s} {'p90':>9s} {'n':>6s}"]
    names = {"inprocess": "in-process decode step",
             "mesh_local": "one-node mesh, per decode token",
             "mesh_remote_token": "two-node mesh, per decode token",
             "mesh_remote_hop": f"one remote hop ({res['hops_per_token']:g} per token)",
             "echo": "aiohttp echo floor, per round trip"}
    for key, label in names.items():
        v = st[key]
        lines.append(f"{label:34s} {v['mean_ms']:9.3f} {v['median_ms']:9.3f} "
                     f"{v['p90_ms']:9.3f} {v['n']:6d}")
    for key, target in res["targets"].items():
        verdict = "meets" if res["targets_met"][key] else "MISSES"
        lines.append(f"{key}: {r[key]:.2f} (median {r[key + '_median']:.2f}; {verdict} the "
                     f"target ≤ {target})")
    if not res["same_tokens"]:
        lines.append("note: the mesh generated other tokens than the in-process model")
    return "\n".join(lines)


def main(as_json: bool = False, rounds: int = 5, tokens: int = 48, generations: int = 3,
         echoes: int = 300, policy: str = "hetroute") -> int:
    import uvloop

    result = uvloop.run(run_bench(rounds, tokens, generations, echoes, policy))
    print(json.dumps(result, indent=2) if as_json else _table(result))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help='print one JSON document: {"inprocess_ms", "mesh_local_ms", '
                   '"mesh_remote_ms", "echo_ms", "ratios", "stats", ...}')
    p.add_argument("--rounds", type=int, default=5, help="measured rounds after a warm-up (5)")
    p.add_argument("--tokens", type=int, default=48, help="tokens per generation (48)")
    p.add_argument("--generations", type=int, default=3,
                   help="generations per round and target (3)")
    p.add_argument("--echoes", type=int, default=300, help="echo round trips per round (300)")
    p.add_argument("--policy", default="hetroute", help="routing policy (hetroute)")


def command(args: argparse.Namespace) -> int:
    """decode step in process, through a one- and a two-node mesh, echo floor

    One tiny-moe decode token: model.forward in this process, the same generation through POST
    /v1/generate of a one-node mesh (every expert local) and of a two-node mesh with zero-delay
    links (every expert on the other node), and the round trip of a plain aiohttp echo; with
    ratios.
    """
    return main(args.json, args.rounds, args.tokens, args.generations, args.echoes, args.policy)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(command(parser.parse_args()))
