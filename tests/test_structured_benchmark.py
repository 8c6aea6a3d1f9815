"""benchmarks/structured.py's bookkeeping, without servers: its workload covers every schema, and
validity counts only finished outputs that parse and validate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import structured as bench


def test_the_workload_cycles_through_every_schema_and_each_schema_is_valid():
    jobs = bench.workload(8)
    assert {schema for schema, _ in jobs} == set(bench.SCHEMAS) and len(jobs) == 8
    for schema in bench.SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_validity_counts_finished_outputs_that_parse_and_validate():
    good = json.dumps({"name": "Ada", "age": 36})
    outs = [
        {"schema": "person", "text": good, "finish": "stop"},
        {"schema": "person", "text": '{"name": "Ada"}', "finish": "stop"},  # parses, misses a required key
        {"schema": "person", "text": '{"name": "Ad', "finish": "length"},  # cut: not finished
        {"schema": "person", "text": "not json", "finish": "stop"},
    ]
    assert bench.validity(outs) == {"requests": 4, "finished": 3, "valid": 1, "valid_share_of_finished": 1 / 3}
