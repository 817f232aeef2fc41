"""The data files benchmarks/ reads are well-formed: benchmarks/data/schemas.jsonl (read by
benchmarks/schema_coverage.py) holds 200 uniquely named JSON Schemas, each valid by its own
draft's metaschema, so a coverage figure never counts a schema that was wrong to begin with."""

from __future__ import annotations

import json

import jsonschema
from docs_support import ROOT

SCHEMAS = ROOT / "benchmarks" / "data" / "schemas.jsonl"


def test_the_coverage_schemas_are_200_valid_named_json_schemas() -> None:
    lines = SCHEMAS.read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 200
    for number, row in enumerate(rows, 1):
        assert isinstance(row, dict) and set(row) == {"name", "schema"}, f"line {number}: {row!r:.80}"
        assert isinstance(row["name"], str) and row["name"], f"line {number}: no name"
        assert isinstance(row["schema"], dict), f"line {number} ({row['name']}): the schema is not an object"
        jsonschema.validators.validator_for(row["schema"]).check_schema(row["schema"])
    names = [row["name"] for row in rows]
    assert len(set(names)) == len(names), f"names repeated: {sorted({n for n in names if names.count(n) > 1})}"
    assert SCHEMAS.stat().st_size < 300_000
