"""Alertmanager webhook receiver: turns firing drift/accuracy alerts into a re-prune.

Bearer token from the environment (401 without it), `resolved` notifications ignored (they clear
the alert's fingerprint), repeats of a firing alert de-duplicated by fingerprint, and one re-prune
per `cooldown_s` whatever fires (drift and accuracy alerts in one burst give one run). The
trigger is injected (flows/receiver.py sends a Prefect event or starts the deployment), so this
module knows nothing of Prefect.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Callable

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse

log = logging.getLogger("pruneops.receiver")


def create_receiver(token: str, trigger: Callable[[dict], str], cooldown_s: float = 600.0) -> FastAPI:
    """Builds the receiver app.

    Args:
        token: The bearer token Alertmanager must send (empty refuses every request).
        trigger: Starts a re-prune for one alert (its Alertmanager JSON); returns a run or event id.
            Called in a worker thread.
        cooldown_s: After a trigger, further new alerts within this many seconds start nothing.
    """
    app = FastAPI(title="PruneOps alert receiver")
    firing: dict[str, float] = {}
    last_trigger = [0.0]
    decisions: list[dict] = []
    lock = threading.Lock()
    app.state.decisions = decisions

    def decide(alert: dict, action: str, detail: str = "") -> None:
        entry = {
            "at": time.time(),
            "alertname": alert.get("labels", {}).get("alertname"),
            "fingerprint": alert.get("fingerprint"),
            "status": alert.get("status"),
            "action": action,
            "detail": detail,
        }
        decisions.append(entry)
        log.info("alert %s (%s, %s): %s %s", entry["alertname"], entry["fingerprint"], entry["status"], action, detail)

    @app.post("/alerts")
    async def alerts(request: Request, authorization: str | None = Header(default=None)) -> dict:
        expected = f"Bearer {token}"
        if not token or authorization is None or not hmac.compare_digest(authorization, expected):
            log.warning("refused webhook without a valid bearer token")
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")
        try:
            payload = await request.json()
            items = list(payload["alerts"])
        except (ValueError, KeyError, TypeError):
            raise HTTPException(status_code=422, detail="not an Alertmanager webhook payload") from None
        counts = {"triggered": 0, "ignored_resolved": 0, "duplicates": 0, "cooldown": 0}
        for alert in items:
            fingerprint = alert.get("fingerprint") or str(sorted(alert.get("labels", {}).items()))
            with lock:
                if alert.get("status") == "resolved":
                    firing.pop(fingerprint, None)
                    counts["ignored_resolved"] += 1
                    decide(alert, "ignored", "resolved")
                    continue
                if fingerprint in firing:
                    counts["duplicates"] += 1
                    decide(alert, "duplicate", "a re-prune was already triggered for this alert")
                    continue
                firing[fingerprint] = time.time()
                if time.time() - last_trigger[0] < cooldown_s:
                    counts["cooldown"] += 1
                    decide(alert, "cooldown", "a re-prune was triggered less than cooldown_s ago")
                    continue
                last_trigger[0] = time.time()
            try:
                run = await asyncio.to_thread(trigger, alert)
            except Exception as exc:
                with lock:  # not handled: let Alertmanager's retry trigger it again
                    firing.pop(fingerprint, None)
                    last_trigger[0] = 0.0
                decide(alert, "trigger failed", f"{type(exc).__name__}: {exc}")
                raise HTTPException(status_code=500, detail=f"re-prune trigger failed: {exc}") from None
            counts["triggered"] += 1
            decide(alert, "triggered", str(run))
        return counts

    @app.get("/decisions")
    def recent_decisions() -> JSONResponse:
        return JSONResponse(decisions[-100:])

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    return app
