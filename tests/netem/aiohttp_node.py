"""A small real aiohttp server for runtime tests: `python aiohttp_node.py NAME PORT`.

GET /       -> {"name": NAME, "pid": ...}
GET /v1/health -> {"name": NAME, "status": "ok"} (what a supervisor asks)
GET /fetch?url=URL -> what URL answered, fetched from inside this node's namespace
"""

from __future__ import annotations

import os
import sys

import aiohttp
from aiohttp import web


async def whoami(request: web.Request) -> web.Response:
    return web.json_response({"name": request.app["name"], "pid": os.getpid(),
                              "netns": os.environ.get("MOEMESH_NETNS")})


async def fetch(request: web.Request) -> web.Response:
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(
        request.query["url"]
    ) as resp:
        return web.json_response(await resp.json())


async def health(request: web.Request) -> web.Response:
    return web.json_response({"name": request.app["name"], "status": "ok"})


def main() -> None:
    app = web.Application()
    app["name"] = sys.argv[1]
    print(f"aiohttp_node {sys.argv[1]} listening on {sys.argv[2]}", flush=True)
    app.router.add_get("/", whoami)
    app.router.add_get("/v1/health", health)
    app.router.add_get("/fetch", fetch)
    web.run_app(app, host="0.0.0.0", port=int(sys.argv[2]), print=None)


if __name__ == "__main__":
    main()
