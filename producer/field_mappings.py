"""Parameter dataclasses built from decoded payloads (a job's JSON, a request's fields)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def from_mapping(cls: type[T], data: Any, name: str, unknown_what: str) -> T:
    """`cls(**data)`, where `data` must be a mapping of `cls`'s fields: an unknown field is an
    error naming it, not silently dropped. `name` is what the payload is called in errors,
    `unknown_what` what its fields are."""
    if not isinstance(data, dict):
        raise ValueError(f"{name} must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - {f.name for f in fields(cls)})  # type: ignore[arg-type]
    if unknown:
        raise ValueError(f"unknown {unknown_what}: {', '.join(unknown)}")
    return cls(**data)
