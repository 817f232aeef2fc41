"""OpenAI's webhooks: when a background response or a batch ends, the API POSTs an event to
GENQ_WEBHOOK_URL, `{"object": "event", "id": "evt_...", "type": "response.completed",
"created_at": ..., "data": {"id": "resp_..."}}`, signed as Standard Webhooks sign (and as
OpenAI signs its own, so `client.webhooks.unwrap(body, headers)` of OpenAI's SDK verifies it):
headers `webhook-id`, `webhook-timestamp` and `webhook-signature: v1,<base64 HMAC-SHA256 of
"id.timestamp.body">` under the secret.

Each event is sent once however many API processes see the end (a Redis SET NX on the event's
name decides which), from a task of the process that won; a receiver that fails (an error
status, no answer) is tried again after 1, 2, 4, ... s (at most 60), up to
GENQ_WEBHOOK_MAX_ATTEMPTS times. A process stopping drops the retries it still owed.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
import uuid
from typing import Any

import httpx
import redis.asyncio

from api.settings import Settings
from producer.protocol import Keys

log = logging.getLogger(__name__)

SENT_TTL_S = 7 * 24 * 3600  # an event's "sent" mark outlives any process that might see the end again
TIMEOUT_S = 10.0  # one delivery attempt
MAX_BACKOFF_S = 60.0


def signing_key(secret: str) -> bytes:
    """The HMAC key a secret names: whsec_<base64> decoded, any other string as it is."""
    return base64.b64decode(secret[6:]) if secret.startswith("whsec_") else secret.encode()


def signed_headers(secret: str, event_id: str, body: str, now: int) -> dict[str, str]:
    digest = hmac.new(signing_key(secret), f"{event_id}.{now}.{body}".encode(), hashlib.sha256).digest()
    return {"webhook-id": event_id, "webhook-timestamp": str(now),
            "webhook-signature": "v1," + base64.b64encode(digest).decode(), "content-type": "application/json"}


class Webhooks:
    """One API process's sender; a no-op without GENQ_WEBHOOK_URL."""

    def __init__(self, settings: Settings, conn: redis.asyncio.Redis, keys: Keys, tasks: set[asyncio.Task[None]]) -> None:
        self.url, self.secret = settings.webhook_url, settings.webhook_secret or ""
        self.max_attempts = settings.webhook_max_attempts
        self.conn, self.keys, self.tasks = conn, keys, tasks

    async def ended(self, kind: str, object_id: str, status: str) -> None:
        """`kind` ("response", "batch") `object_id` ended with `status`: announce it once."""
        if self.url is None:
            return
        event_type = f"{kind}.{status}"
        if not await self.conn.set(self.keys.webhook_sent(f"{event_type}:{object_id}"), 1, nx=True, ex=SENT_TTL_S):
            return  # another process (or an earlier end of this one) sent it
        event = {"object": "event", "id": f"evt_{uuid.uuid4().hex}", "type": event_type,
                 "created_at": int(time.time()), "data": {"id": object_id}}
        task = asyncio.create_task(self._deliver(event), name=f"genq-webhook-{event['id']}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _deliver(self, event: dict[str, Any]) -> None:
        body = json.dumps(event)
        delay = 1.0
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
            for attempt in range(1, self.max_attempts + 1):
                try:
                    reply = await http.post(str(self.url), content=body,
                                            headers=signed_headers(self.secret, event["id"], body, int(time.time())))
                    if reply.is_success:
                        return
                    why = f"status {reply.status_code}"
                except httpx.HTTPError as exc:
                    why = f"{type(exc).__name__}: {exc}"
                log.warning("webhook %s (%s) attempt %d of %d failed: %s", event["id"], event["type"], attempt,
                            self.max_attempts, why)
                if attempt < self.max_attempts:
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, MAX_BACKOFF_S)
        log.error("webhook %s (%s) given up after %d attempts", event["id"], event["type"], self.max_attempts)
