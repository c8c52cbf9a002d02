"""Container healthcheck: exits 0 when a URL answers with 2xx (slim images have no curl).

python -m pruneops.serving.healthcheck [URL]   # default: this container's serving app /healthz
"""

from __future__ import annotations

import os
import sys
import urllib.request


def check(url: str, timeout: float = 4.0) -> str | None:
    """None when `url` answers with 2xx, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return None if 200 <= response.status < 300 else f"HTTP {response.status}"
    except OSError as exc:
        return str(exc)


def main(argv: list[str] | None = None) -> int:
    """Entry point; the default URL follows PRUNEOPS_PORT, as the serving image's command does."""
    args = sys.argv[1:] if argv is None else argv
    url = args[0] if args else f"http://127.0.0.1:{os.environ.get('PRUNEOPS_PORT', '8000')}/healthz"
    problem = check(url)
    if problem is not None:
        print(f"unhealthy: {url}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
