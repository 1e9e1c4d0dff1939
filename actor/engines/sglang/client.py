"""JSON over HTTP to a SGLang server, with bounded retries on connection errors and 5xx (logged ``attempt i/n``),
and none once the server this actor launched is known to be dead."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from actor.engines.base import EngineError

log = logging.getLogger(__name__)


class SGLangClient:
    """JSON over HTTP with bounded retries (connection errors and 5xx), logged ``attempt i/n``."""

    def __init__(self, url: str, timeout_s: float, retries: int, gone: Callable[[], str | None] = lambda: None):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.gone = gone  # why the server is known to be dead (a launched one): no point in retrying

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        ok_statuses: tuple[int, ...] = (),
        timeout_s: float | None = None,
        retries: int | None = None,
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        total = (self.retries if retries is None else retries) + 1
        for attempt in range(1, total + 1):
            req = urllib.request.Request(self.url + path, data=data, method=method)
            req.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                    return _reply_body(resp.read())
            except urllib.error.HTTPError as e:
                raw = e.read()
                if e.code in ok_statuses:  # an answer, not a failure (e.g. 400 with success: false)
                    return _reply_body(raw)
                if e.code < 500 or attempt == total:
                    raise EngineError(f"{method} {path}: HTTP {e.code}: {raw[:500].decode(errors='replace')}") from None
                error: Exception = e
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                if why := self.gone():
                    raise EngineError(why) from None
                if attempt == total:
                    raise EngineError(f"{method} {path}: {e} (after {total} attempts)") from None
                error = e
            log.warning("sglang %s %s: %s (attempt %d/%d, retrying)", method, path, error, attempt, total)
            time.sleep(min(5.0, 0.2 * 2**attempt))
        raise AssertionError("unreachable")

    def healthy(self) -> bool:
        try:
            req = urllib.request.Request(self.url + "/health")
            with urllib.request.urlopen(req, timeout=min(self.timeout_s, 30.0)) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False


def _reply_body(raw: bytes) -> Any:
    """JSON, or the text some endpoints answer with (``/flush_cache``)."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
