"""Alertmanager webhook receiver: turns firing drift/accuracy alerts into a re-prune.

Bearer token from the environment (401 for a missing, wrong or malformed header, on every
endpoint but /healthz), `resolved` notifications ignored (they clear the alert's fingerprint),
repeats of an alert that triggered de-duplicated by fingerprint until it resolves, and one
re-prune per `cooldown_s` whatever fires (drift and accuracy alerts in one burst give one run).
An alert that arrives during the cooldown is answered "cooldown" and not remembered, so that
Alertmanager's next repeat of it, once the cooldown is over, triggers. The trigger is injected
(flows/receiver.py starts the Prefect deployment) and must return only once the re-prune is
confirmed (e.g. the flow run was created): if it raises, the receiver answers 503, forgets the
alert and keeps no cooldown, so Alertmanager's retry triggers it again. While one trigger is in
flight, a delivery that would trigger is answered 503 as well (retried), never acknowledged and
then lost with a trigger that fails.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pruneops.serving.limits import BodyLimit

log = logging.getLogger("pruneops.receiver")
MAX_BODY_BYTES = 1 << 20  # Alertmanager batches are a few KB


class Alert(BaseModel):
    """One alert of an Alertmanager webhook (fields the receiver does not use are allowed)."""

    model_config = ConfigDict(extra="allow")

    status: Annotated[str, Field(max_length=32)] = "firing"
    fingerprint: Annotated[str, Field(max_length=128)] | None = None
    labels: dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=dict
    )


class Webhook(BaseModel):
    """Alertmanager's webhook payload (version 4)."""

    model_config = ConfigDict(extra="allow")

    alerts: Annotated[list[Alert], Field(max_length=1000)]


class Counts(BaseModel):
    """What the receiver did with a payload's alerts."""

    triggered: int = 0
    ignored_resolved: int = 0
    duplicates: int = 0
    cooldown: int = 0


IN_FLIGHT = "in flight"  # `classify`'s answer while another trigger is unconfirmed


class ReceiverState:
    """Firing fingerprints, the last confirmed trigger and the decision log, behind one lock."""

    def __init__(self, cooldown_s: float):
        self.cooldown_s = cooldown_s
        self.firing: dict[str, float] = {}
        self.last_trigger = 0.0
        self.in_flight = False
        self.decisions: deque[dict[str, Any]] = deque(maxlen=1000)
        self.lock = threading.Lock()

    def decide(self, alert: Alert, action: str, detail: str = "") -> None:
        """Logs what was done with an alert."""
        entry = {
            "at": time.time(),
            "alertname": alert.labels.get("alertname"),
            "fingerprint": alert.fingerprint,
            "status": alert.status,
            "action": action,
            "detail": detail,
        }
        self.decisions.append(entry)
        log.info("alert %s (%s, %s): %s %s", entry["alertname"], entry["fingerprint"], alert.status, action, detail)

    def classify(self, alert: Alert, counts: Counts) -> str | None:
        """Records a resolved, repeated or cooled-down alert; returns its key when it is to trigger.

        Returns `IN_FLIGHT` when it would trigger while another trigger is unconfirmed.
        """
        key = alert.fingerprint or str(sorted(alert.labels.items()))
        with self.lock:
            if alert.status == "resolved":
                self.firing.pop(key, None)
                counts.ignored_resolved += 1
                self.decide(alert, "ignored", "resolved")
                return None
            if key in self.firing:
                counts.duplicates += 1
                self.decide(alert, "duplicate", "a re-prune was already triggered for this alert")
                return None
            if self.in_flight:
                self.decide(alert, "retry", "another re-prune trigger is in flight: answered 503")
                return IN_FLIGHT
            if time.time() - self.last_trigger < self.cooldown_s:
                counts.cooldown += 1  # not remembered: its repeat after the cooldown triggers
                self.decide(alert, "cooldown", "a re-prune was triggered less than cooldown_s ago")
                return None
            # Claimed now so that a concurrent delivery of the same burst does not trigger twice.
            self.firing[key] = time.time()
            self.in_flight = True
            return key

    def confirm(self) -> None:
        """The claimed trigger is confirmed: the cooldown starts."""
        with self.lock:
            self.last_trigger = time.time()
            self.in_flight = False

    def release(self, key: str) -> None:
        """Forgets a claimed alert whose trigger failed, so that a retry triggers it."""
        with self.lock:
            self.firing.pop(key, None)
            self.in_flight = False


def _authorized(token: str):
    """A dependency: 401 unless the Authorization header is exactly `Bearer <token>`."""

    def check(authorization: Annotated[str | None, Header()] = None) -> None:
        expected = f"Bearer {token}".encode()
        given = (authorization or "").encode("utf-8", "surrogateescape")
        if not token or not hmac.compare_digest(given, expected):
            log.warning("refused a request without a valid bearer token")
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    return check


def create_receiver(token: str, trigger: Callable[[dict], str], cooldown_s: float = 600.0) -> FastAPI:
    """Builds the receiver app.

    Args:
        token: The bearer token Alertmanager must send (empty refuses every request).
        trigger: Starts a re-prune for one alert (its Alertmanager JSON) and returns a run id once
            it is confirmed; raises otherwise. Called in a worker thread.
        cooldown_s: After a confirmed trigger, further new alerts within this many seconds start nothing.
    """
    app = FastAPI(title="PruneOps alert receiver")
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    state = ReceiverState(cooldown_s)
    app.state.receiver = state
    app.state.decisions = state.decisions
    auth = [Depends(_authorized(token))]

    @app.exception_handler(RequestValidationError)
    async def malformed(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return JSONResponse({"detail": f"not an Alertmanager webhook payload: {where}: {first.get('msg')}"}, 422)

    @app.post("/alerts", dependencies=auth, responses={401: {}, 422: {}, 503: {}})
    async def alerts(payload: Webhook) -> Counts:
        counts = Counts()
        for alert in payload.alerts:
            key = state.classify(alert, counts)
            if key is None:
                continue
            if key == IN_FLIGHT:
                raise HTTPException(status_code=503, detail="another re-prune trigger is in flight; retry")
            try:
                run = await asyncio.to_thread(trigger, alert.model_dump())
            except Exception as exc:  # noqa: BLE001 - not confirmed: let Alertmanager's retry trigger it
                state.release(key)
                state.decide(alert, "trigger failed", f"{type(exc).__name__}: {str(exc)[:200]}")
                raise HTTPException(
                    status_code=503, detail=f"re-prune trigger not confirmed: {str(exc)[:200]}"
                ) from None
            state.confirm()
            counts.triggered += 1
            state.decide(alert, "triggered", str(run))
        return counts

    @app.get("/decisions", dependencies=auth, responses={401: {}})
    def recent_decisions() -> list[dict[str, Any]]:
        return list(state.decisions)[-100:]

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
