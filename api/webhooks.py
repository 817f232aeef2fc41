"""OpenAI's webhooks: when a background response or a batch ends, the API POSTs an event to
GENQ_WEBHOOK_URL, `{"object": "event", "id": "evt_...", "type": "response.completed",
"created_at": ..., "data": {"id": "resp_..."}}`, signed as Standard Webhooks sign (and as
OpenAI signs its own, so `client.webhooks.unwrap(body, headers)` of OpenAI's SDK verifies it):
headers `webhook-id`, `webhook-timestamp` and `webhook-signature: v1,<base64 HMAC-SHA256 of
"id.timestamp.body">` under the secret.

Events go through an outbox in Redis, so none is lost with an API process: `ended` adds the
event to the stream `webhook_outbox` once however many processes see the end (a SET NX on the
event's name decides), and every API process's sender reads it in the consumer group
`webhook_senders`. A delivery that succeeds is acknowledged and deleted; one that fails (an
error status, no answer within TIMEOUT_S) stays pending, and is claimed again, by any process,
once it has been idle 1, 2, 4, ... s (at most 60) after its last attempt, up to
GENQ_WEBHOOK_MAX_ATTEMPTS attempts. A process that stops leaves its pending events to the others.
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

import httpx
import redis
import redis.asyncio

from api.settings import Settings
from producer.protocol import Keys
from producer.redis_conn import REDIS_AWAY, ordered_writes

log = logging.getLogger(__name__)

SENT_TTL_S = 7 * 24 * 3600  # an event's "sent" mark outlives any process that might see the end again
TIMEOUT_S = 10.0  # one delivery attempt
MAX_BACKOFF_S = 60.0
READ_BLOCK_MS = 1000  # the sender's longest wait for new events: bounds how late a retry is seen
BATCH = 16  # events read or retried at once


def signing_key(secret: str) -> bytes:
    """The HMAC key a secret names: whsec_<base64> decoded, any other string as it is."""
    return base64.b64decode(secret[6:]) if secret.startswith("whsec_") else secret.encode()


def signed_headers(secret: str, event_id: str, body: str, now: int) -> dict[str, str]:
    digest = hmac.new(signing_key(secret), f"{event_id}.{now}.{body}".encode(), hashlib.sha256).digest()
    return {"webhook-id": event_id, "webhook-timestamp": str(now),
            "webhook-signature": "v1," + base64.b64encode(digest).decode(), "content-type": "application/json"}


def backoff_s(attempts: int) -> float:
    """How long an event rests after its `attempts`-th failed attempt."""
    return min(2.0 ** (attempts - 1), MAX_BACKOFF_S)


# Drop stopped senders. KEYS[1]: the outbox. ARGV[1] the group, [2] this sender, [3] idle ms.
# One script: a sender is dropped only if it still has nothing pending (XGROUP DELCONSUMER
# would lose what it holds). Returns the names dropped.
PRUNE_LUA = """
local gone = {}
for _, row in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #row, 2 do info[row[i]] = row[i + 1] end
  if info['name'] ~= ARGV[2] and info['pending'] == 0 and info['idle'] >= tonumber(ARGV[3]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info['name'])
    gone[#gone + 1] = info['name']
  end
end
return gone
"""


class Webhooks:
    """One API process's side of the outbox: adding events, and (`run`) sending them; a no-op
    without GENQ_WEBHOOK_URL."""

    def __init__(self, settings: Settings, conn: redis.asyncio.Redis, keys: Keys) -> None:
        self.url, self.secret = settings.webhook_url, settings.webhook_secret or ""
        self.max_attempts = settings.webhook_max_attempts
        self.sender_ttl_s = settings.webhook_sender_ttl_s
        self._pruned_at = -settings.webhook_sender_ttl_s  # (monotonic)
        self.conn, self.keys = conn, keys
        self.consumer = f"api-{uuid.uuid4().hex[:12]}"

    async def ended(self, kind: str, object_id: str, status: str) -> None:
        """`kind` ("response", "batch") `object_id` ended with `status`: announce it once."""
        if self.url is None:
            return
        event_type = f"{kind}.{status}"
        if not await self.conn.set(self.keys.webhook_sent(f"{event_type}:{object_id}"), 1, nx=True, ex=SENT_TTL_S):
            return  # another process (or an earlier end of this one) queued it
        event = {"object": "event", "id": f"evt_{uuid.uuid4().hex}", "type": event_type,
                 "created_at": int(time.time()), "data": {"id": object_id}}
        await self.conn.xadd(self.keys.webhook_outbox, {"event": json.dumps(event)})

    async def run(self) -> None:
        """Send the outbox's events until cancelled: new ones as they come, failed ones again
        when their rest is over."""
        if self.url is None:
            return
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
            grouped = False
            while True:
                try:
                    if not grouped:
                        await self._ensure_group()
                        grouped = True
                    await self._retry(http)
                    await self._send_new(http)
                    await self._prune()
                except REDIS_AWAY as exc:
                    log.warning("webhook sender: Redis unavailable (%s); retrying", exc)
                    await asyncio.sleep(1.0)
                except redis.ResponseError as exc:
                    if "NOGROUP" not in str(exc):
                        raise
                    grouped = False  # the outbox was deleted (FLUSHALL): made again

    async def _ensure_group(self) -> None:
        try:
            await self.conn.xgroup_create(self.keys.webhook_outbox, self.keys.webhook_senders, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _prune(self) -> None:
        """Drop from the group the senders of API processes that stopped: unseen for
        GENQ_WEBHOOK_SENDER_TTL_S, with nothing pending (their pending events are claimed by
        the others first). Without it every restart would leave a consumer behind for good."""
        if time.monotonic() - self._pruned_at < self.sender_ttl_s / 2:
            return
        self._pruned_at = time.monotonic()
        gone = await self.conn.eval(PRUNE_LUA, 1, self.keys.webhook_outbox, self.keys.webhook_senders,  # type: ignore[misc]
                                    self.consumer, str(int(self.sender_ttl_s * 1000)))
        if gone:
            log.info("webhook senders gone for %.0f s left the group: %s", self.sender_ttl_s,
                     ", ".join(g.decode() for g in gone))

    async def _send_new(self, http: httpx.AsyncClient) -> None:
        reply = await self.conn.xreadgroup(self.keys.webhook_senders, self.consumer, {self.keys.webhook_outbox: ">"},
                                           count=BATCH, block=READ_BLOCK_MS)
        entries = reply[0][1] if reply else []
        await asyncio.gather(*(self._attempt(http, entry_id, fields, 1) for entry_id, fields in entries))

    async def _retry(self, http: httpx.AsyncClient) -> None:
        """Claim pending events (of any process) whose rest after their last attempt is over."""
        rows = await self.conn.xpending_range(self.keys.webhook_outbox, self.keys.webhook_senders, "-", "+", BATCH * 8,
                                              idle=int(backoff_s(1) * 1000))
        due = [r for r in rows if r["time_since_delivered"] >= backoff_s(r["times_delivered"]) * 1000][:BATCH]
        attempts = []
        for row in due:
            claimed = await self.conn.xclaim(self.keys.webhook_outbox, self.keys.webhook_senders, self.consumer,
                                             int(backoff_s(row["times_delivered"]) * 1000), [row["message_id"]])
            attempts += [(entry_id, fields, row["times_delivered"] + 1) for entry_id, fields in claimed if fields]
        await asyncio.gather(*(self._attempt(http, *attempt) for attempt in attempts))

    async def _attempt(self, http: httpx.AsyncClient, entry_id: bytes, fields: dict[bytes, bytes], attempt: int) -> None:
        """One delivery; the event leaves the outbox once delivered or out of attempts."""
        body = fields[b"event"].decode()
        event = json.loads(body)
        try:
            reply = await http.post(str(self.url), content=body,
                                    headers=signed_headers(self.secret, event["id"], body, int(time.time())))
            why = None if reply.is_success else f"status {reply.status_code}"
        except httpx.HTTPError as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why is None or attempt >= self.max_attempts:
            if why is not None:
                log.error("webhook %s (%s) given up after %d attempts: %s", event["id"], event["type"], attempt, why)
            pipe = ordered_writes(self.conn)
            pipe.xack(self.keys.webhook_outbox, self.keys.webhook_senders, entry_id)
            pipe.xdel(self.keys.webhook_outbox, entry_id)
            await pipe.execute()
            return
        log.warning("webhook %s (%s) attempt %d of %d failed: %s; again in %.0f s", event["id"], event["type"],
                    attempt, self.max_attempts, why, backoff_s(attempt))
