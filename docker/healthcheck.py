"""Container health check: exit 0 when this container's node answers GET /v1/health with 200.

Run by the image's HEALTHCHECK (and compose's). The port is MOEMESH_PORT (default 8000); the
mesh token, when set, is sent, so it works whether or not health needs it. Standard library
only: it runs every few seconds and must start fast.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("MOEMESH_PORT", "8000")
    url = f"http://127.0.0.1:{port}/v1/health"
    request = urllib.request.Request(url)
    token = os.environ.get("MOEMESH_TOKEN")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=3) as answer:
            body = answer.read(500).decode("utf-8", "replace")
            print(body)
            return 0 if answer.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
