"""API keys kept in Redis, each with its own plan: a name its usage is metered under, its own
requests and tokens per minute, the models it may use. `genq keys create NAME` makes one and
prints it once; every API process reads them at once, and a revoked key stops working within
a second.

Redis holds no secret: `api_keys` maps each key's SHA-256 digest to its plan (JSON). Once a
key exists the API asks for a key on every /v1 route, as it does with GENQ_API_KEYS (whose
keys keep working beside these, with the GENQ_RATE_LIMIT_* limits and every model).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from contextvars import ContextVar
from dataclasses import asdict, dataclass, replace
from typing import Any

import redis.asyncio

from producer.protocol import Keys

KEY_PREFIX = "sk-genq-"
CACHE_S = 1.0  # how long an API process trusts what it read: a revoke takes effect within this
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a tenant name (producer.protocol's rule)


@dataclass(frozen=True)
class KeyPlan:
    """What one managed key may do; None: the API's defaults (GENQ_RATE_LIMIT_*, every model)."""

    name: str  # its jobs' tenant: usage is metered under it
    rpm: int | None = None
    tpm: int | None = None
    models: tuple[str, ...] | None = None  # the model names it may ask for, aliases and adapters included
    created_at: float = 0.0
    priority: int = 0  # added to its requests' priority: a tier (lower runs first, as vLLM's; see job_priority)
    max_in_flight: int | None = None  # its jobs queued or running at once (None: no limit)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "models": list(self.models) if self.models is not None else None})

    @classmethod
    def from_json(cls, text: bytes | str) -> KeyPlan:
        data = json.loads(text)
        models = data.get("models")
        return cls(data["name"], data.get("rpm"), data.get("tpm"), tuple(models) if models is not None else None,
                   data.get("created_at", 0.0), data.get("priority", 0), data.get("max_in_flight"))

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


# The plan of the managed key a request came with (None: keys are off, or a GENQ_API_KEYS key).
# Set with deps.TENANT by `require_api_key`; tasks a request starts inherit it.
PLAN: ContextVar[KeyPlan | None] = ContextVar("genq_key_plan", default=None)


def in_flight_limit() -> tuple[str, int] | None:
    """(the key's name, its limit) when the caller's managed key limits its jobs in flight."""
    plan = PLAN.get()
    return (plan.name, plan.max_in_flight) if plan is not None and plan.max_in_flight is not None else None


def job_priority(requested: int) -> int:
    """The priority a caller's job runs at, for the `priority` its request asked (lower runs
    first). A managed key's tier is added to it, and such a caller may only lower its
    precedence: a negative request counts as 0, so no request jumps the tiers (each priority's
    sign picks its lane). Callers of GENQ_API_KEYS or of an open API are trusted as vLLM's."""
    plan = PLAN.get()
    return requested if plan is None else plan.priority + max(requested, 0)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_plan(plan: KeyPlan) -> None:
    """ValueError naming what is wrong with a plan about to be stored."""
    if not _NAME.fullmatch(plan.name) or plan.name.startswith("key-"):
        raise ValueError(f"a key's name is 1 to 64 letters, digits, '.', '_' or '-', not starting with "
                         f"'key-' (GENQ_API_KEYS keys are metered as key-<digest>), got {plan.name!r}")
    for field in ("rpm", "tpm", "max_in_flight"):
        value = getattr(plan, field)
        if value is not None and value < 1:
            raise ValueError(f"{field} must be at least 1, got {value}")
    if plan.models is not None and not all(plan.models):
        raise ValueError(f"models must be model names, got {list(plan.models)}")


async def create(conn: redis.asyncio.Redis, keys: Keys, plan: KeyPlan) -> str:
    """Store a new key with `plan` and return it (its only copy: Redis keeps its digest)."""
    check_plan(plan)
    if any(p.name == plan.name for p in await listing(conn, keys)):
        raise ValueError(f"a key named {plan.name!r} exists; revoke it first, or choose another name")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    stamped = replace(plan, created_at=time.time())
    await conn.hset(keys.api_keys, digest(key), stamped.to_json())  # type: ignore[misc]
    return key


# Replace one key's plan if it is still the one read. KEYS[1]: api_keys. ARGV[1]: the key's
# digest, [2]: its plan as read, [3]: the new plan. Returns 1, or 0 when the plan changed or
# the key was revoked meanwhile (a change must not bring a revoked key back).
_SET_PLAN_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""


UPDATE_ATTEMPTS = 8  # reads of a plan that others keep changing before update gives up


async def update(conn: redis.asyncio.Redis, keys: Keys, name: str, **changes: Any) -> KeyPlan:
    """Change the plan of the key named `name` (the KeyPlan fields given; None clears a limit
    back to the server's default) and return it; the key itself stays. ValueError when there
    is no such key, or the change breaks check_plan. A plan changed meanwhile is read again
    and changed anew (the fields given win, the others keep the other change). API processes
    see it within CACHE_S."""
    for _ in range(UPDATE_ATTEMPTS):
        stored = await conn.hgetall(keys.api_keys)  # type: ignore[misc]
        found = [(field, value) for field, value in stored.items() if KeyPlan.from_json(value).name == name]
        if not found:
            raise ValueError(f"no key named {name!r}")
        field, old = found[0]
        plan = replace(KeyPlan.from_json(old), **changes)
        check_plan(plan)
        if await set_plan(conn, keys, field, old, plan):
            return plan
    raise ValueError(f"the key {name!r} changed {UPDATE_ATTEMPTS} times while this change was made: run it again")


async def set_plan(conn: redis.asyncio.Redis, keys: Keys, field: bytes, read: bytes, plan: KeyPlan) -> bool:
    """Store `plan` for the key whose digest is `field` if its stored plan is still `read`.

    Race prevented: a `genq keys set` that read a plan just before a revoke writing the key
    back (or overwriting another change)."""
    return bool(await conn.eval(_SET_PLAN_LUA, 1, keys.api_keys, field, read, plan.to_json()))  # type: ignore[arg-type, misc]


async def revoke(conn: redis.asyncio.Redis, keys: Keys, name: str) -> bool:
    """Delete the key named `name`; False when there is none."""
    stored = await conn.hgetall(keys.api_keys)  # type: ignore[misc]
    fields = [field for field, value in stored.items() if KeyPlan.from_json(value).name == name]
    if fields:
        await conn.hdel(keys.api_keys, *fields)  # type: ignore[misc]
    return bool(fields)


async def listing(conn: redis.asyncio.Redis, keys: Keys) -> list[KeyPlan]:
    stored = await conn.hgetall(keys.api_keys)  # type: ignore[misc]
    return sorted((KeyPlan.from_json(v) for v in stored.values()), key=lambda p: p.name)


class ManagedKeys:
    """An API process's view of the managed keys, each answer kept CACHE_S."""

    def __init__(self, conn: redis.asyncio.Redis, keys: Keys) -> None:
        self.conn = conn
        self.keys = keys
        self._any: tuple[float, bool] = (-CACHE_S, False)
        self._plans: dict[str, tuple[float, KeyPlan | None]] = {}

    async def any(self) -> bool:
        """Whether any managed key exists (then every request needs a key)."""
        read_at, exists = self._any
        if time.monotonic() - read_at >= CACHE_S:
            exists = bool(await self.conn.exists(self.keys.api_keys))
            self._any = (time.monotonic(), exists)
        return exists

    async def plan(self, key: str) -> KeyPlan | None:
        """The plan of `key`; None for a key that is not one."""
        hashed = digest(key)
        read_at, plan = self._plans.get(hashed, (-CACHE_S, None))
        if time.monotonic() - read_at >= CACHE_S:
            stored = await self.conn.hget(self.keys.api_keys, hashed)  # type: ignore[misc]
            plan = KeyPlan.from_json(stored) if stored is not None else None
            if len(self._plans) > 10_000:  # (guessed keys must not grow this without bound)
                self._plans.clear()
            self._plans[hashed] = (time.monotonic(), plan)
        return plan
