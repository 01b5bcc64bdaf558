"""`moemesh bench node`: forward latency of one edge node beside the floor of a plain echo server.

On loopback, in this run: one `moemesh node` process (tiny-moe, modeled compute on a device
profile so fast that no emulated delay is added, every expert of layer 0 in the GPU tier) and
one plain aiohttp echo server process that answers each body with as many bytes as the node's
answer has. The same client (aiohttp, keep-alive, pre-packed bodies) sends forward requests of
1, 2 and 8 items of one f32 row each, one at a time and 16 in flight, to both, in alternating
rounds so drift on this shared host hits both alike. Reported per case: p50/p99 latency and
requests/s; the headline is the ratio of the node's 1-item sequential p50 to the echo floor's
(target ≤ 1.5). A last row times the same 1-item request through `services.NodeClient`
(encoding and decoding included), which is what the router pays.

    python -m bench.node [--json] [--requests N]      (also: moemesh bench node)
    python -m bench.node echo --port 0                  (the echo server alone)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from moe.vocab import FULL_PRECISION, PlacementEntry

__all__ = ["main", "run_bench"]

ITEMS = (1, 2, 8)
INFLIGHT = (1, 16)
TARGET_RATIO = 1.5
REPLY_HEADER = "X-Reply-Bytes"
ROOT = Path(__file__).resolve().parents[1]


# -- the echo floor ---------------------------------------------------------------------------
async def _echo_server(port: int) -> None:
    from aiohttp import web

    replies: dict[int, bytes] = {}

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        n = int(request.headers.get(REPLY_HEADER, len(body)))
        if n not in replies:
            replies[n] = b"\x00" * n
        return web.Response(body=replies[n], content_type="application/msgpack")

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/forward", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    print(f"echo ready on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


# -- processes --------------------------------------------------------------------------------
async def _spawn(args: Sequence[str], env: dict[str, str]) -> tuple[asyncio.subprocess.Process,
                                                                     str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        async with asyncio.timeout(120):
            line = (await proc.stdout.readline()).decode()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"{' '.join(args)} did not start within 120 s") from None
    match = re.search(r"ready on (http://\S+)", line)
    if match is None:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"{' '.join(args)} did not start: {line!r}")
    return proc, match.group(1)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            async with asyncio.timeout(30):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


# -- measuring --------------------------------------------------------------------------------
def _pct(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]


Send = Callable[[], Awaitable[Any]]


async def _round(send: Send, count: int, inflight: int) -> tuple[list[float], float]:
    """`count` requests, `inflight` at a time; (latencies in ms, wall seconds)."""
    lat: list[float] = []
    left = count

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t = time.perf_counter()
            await send()
            lat.append((time.perf_counter() - t) * 1e3)

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(inflight):
            tg.create_task(worker())
    return lat, time.perf_counter() - t0


def _post(session: Any, url: str, body: bytes, headers: dict[str, str]) -> Send:
    async def send() -> None:
        async with session.post(url, data=body, headers=headers) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{url} answered {resp.status}")

    return send


async def run_bench(requests: int = 2000, model: str = "tiny-moe",
                    compute: str = "modeled") -> dict[str, Any]:
    import aiohttp
    import torch

    from services import ClientSettings, NodeClient
    from services.compute import make_compute
    from services.wire import CONTENT_TYPE, expert_group, pack_request

    shape = make_compute(model, "modeled").shape
    token = secrets.token_hex(8)
    env = dict(os.environ, MOEMESH_TOKEN=token)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs: list[asyncio.subprocess.Process] = []
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            profile = Path(tmp) / "bench-device.json"
            profile.write_text(json.dumps({"gpu_tflops": 1e9, "gpu_mem_gb": 1e4,
                                           "cpu_mem_gb": 1e4, "h2d_gbps": 1e6}))
            node, node_url = await _spawn(
                ["-m", "services", "node", "--name", "bench", "--port", "0", "--model", model,
                 "--compute", compute, "--profile", str(profile)], env)
            procs.append(node)
        echo, echo_url = await _spawn(["-m", "bench.node", "echo", "--port", "0"], env)
        procs.append(echo)
        async with NodeClient(ClientSettings(token=token)) as client:
            await client.put_placement(node_url, [
                PlacementEntry(0, e, FULL_PRECISION, "gpu").to_json()
                for e in range(shape.experts)])
            connector = aiohttp.TCPConnector(limit=max(INFLIGHT))
            replies: dict[int, int] = {}
            async with aiohttp.ClientSession(connector=connector) as session:
                for n_items in ITEMS:
                    items = [expert_group(0, e % shape.experts, torch.randn(1, shape.d_model))
                             for e in range(n_items)]
                    body = pack_request(items, req="bench")
                    headers = {"Content-Type": CONTENT_TYPE}
                    async with session.post(node_url + "/v1/forward", data=body,
                                            headers=headers) as resp:
                        reply = replies[n_items] = len(await resp.read())
                    sends = {
                        "node": _post(session, node_url + "/v1/forward", body, headers),
                        "echo": _post(session, echo_url + "/v1/forward", body,
                                      {**headers, REPLY_HEADER: str(reply)}),
                    }
                    for inflight in INFLIGHT:
                        rows += await _measure(sends, n_items, inflight, requests,
                                               len(body), reply)

                async def via_client() -> None:
                    await client.forward(node_url, items[:1], req="bench")

                await _round(via_client, 200, 1)  # warm-up
                lat, wall = await _round(via_client, requests, 1)
                rows.append(_row("node (NodeClient)", 1, 1, lat, wall, len(pack_request(
                    items[:1], req="bench")), replies[1]))
    finally:
        await asyncio.gather(*(_stop(p) for p in procs))
    base = {(r["target"], r["items"], r["inflight"]): r for r in rows}
    ratio = base[("node", 1, 1)]["p50_ms"] / base[("echo", 1, 1)]["p50_ms"]
    return {
        "model": model, "compute": compute, "requests": requests,
        "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
        "rows": rows,
        "ratio_p50_1item": round(ratio, 3),
        "ratios_p50": {f"{i} items x{f}": round(base[("node", i, f)]["p50_ms"]
                                                / base[("echo", i, f)]["p50_ms"], 3)
                       for i in ITEMS for f in INFLIGHT},
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio <= TARGET_RATIO,
    }


async def _measure(sends: dict[str, Send], n_items: int, inflight: int, requests: int,
                   req_bytes: int, resp_bytes: int) -> list[dict[str, Any]]:
    """Alternate rounds between the targets; the first round of each is a warm-up."""
    rounds = 5
    per_round = max(requests // rounds, inflight)
    lat: dict[str, list[float]] = {k: [] for k in sends}
    wall: dict[str, float] = dict.fromkeys(sends, 0.0)
    for send in sends.values():
        await _round(send, min(200, per_round), inflight)
    for _ in range(rounds):
        for name, send in sends.items():
            got, secs = await _round(send, per_round, inflight)
            lat[name] += got
            wall[name] += secs
    return [_row(name, n_items, inflight, lat[name], wall[name], req_bytes, resp_bytes)
            for name in sends]


def _row(target: str, n_items: int, inflight: int, lat: list[float], wall: float,
         req_bytes: int, resp_bytes: int) -> dict[str, Any]:
    s = sorted(lat)
    return {"target": target, "items": n_items, "inflight": inflight,
            "req_bytes": req_bytes, "resp_bytes": resp_bytes,
            "p50_ms": round(_pct(s, 0.50), 4), "p99_ms": round(_pct(s, 0.99), 4),
            "rps": round(len(s) / wall, 1)}


def _table(result: dict[str, Any]) -> str:
    lines = [f"moemesh bench node: {result['model']} ({result['compute']} compute), "
             f"{result['requests']} requests per case, load avg {result['load_avg_1m']} on "
             f"{result['cpus']} CPUs",
             f"{'target':18s} {'items':>5s} {'inflight':>8s} {'req B':>6s} {'resp B':>6s} "
             f"{'p50 ms':>8s} {'p99 ms':>8s} {'req/s':>8s}"]
    for r in result["rows"]:
        lines.append(f"{r['target']:18s} {r['items']:5d} {r['inflight']:8d} {r['req_bytes']:6d} "
                     f"{r['resp_bytes']:6d} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} "
                     f"{r['rps']:8.0f}")
    verdict = "meets" if result["meets_target"] else "MISSES"
    lines.append(f"1-item p50, node / echo floor: {result['ratio_p50_1item']:.2f} "
                 f"({verdict} the target ≤ {result['target_ratio']})")
    return "\n".join(lines)


def main(requests: int = 2000, model: str = "tiny-moe", compute: str = "modeled",
         as_json: bool = False) -> int:
    if requests < 50:
        raise ValueError(f"--requests must be >= 50, got {requests}")
    import uvloop

    result = uvloop.run(run_bench(requests, model, compute))
    print(json.dumps(result, indent=2) if as_json else _table(result))
    return 0


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.node", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["bench", "echo"], default="bench")
    parser.add_argument("--port", type=int, default=0, help="echo mode: port (0: any)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--requests", type=int, default=2000, help="requests per case")
    parser.add_argument("--model", default="tiny-moe", help="model (tiny-moe)")
    parser.add_argument("--compute", choices=["modeled", "real"], default="modeled")
    args = parser.parse_args(argv)
    if args.mode == "echo":
        import uvloop

        with contextlib.suppress(KeyboardInterrupt):
            uvloop.run(_echo_server(args.port))
        return 0
    return main(args.requests, args.model, args.compute, args.json)


if __name__ == "__main__":
    sys.exit(_cli())
