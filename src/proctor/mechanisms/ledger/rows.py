"""A ledger row: its shape, and the canonical JSON and hash that chain it to the row before.

Owns `Row` (a row as read back), `Entry` (a row to append), `GENESIS`, `canonical_json` and `row_hash`, and
reading a stored payload back. It never opens the file: proctor.mechanisms.ledger.store does.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

GENESIS = "0" * 64


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def row_hash(prev_hash: str, row_id: int, ts: str, kind: str, job_id: str | None, payload: str) -> str:
    # Canonical JSON of a list, not a joined string: a separator inside a field cannot forge another row.
    material = canonical_json([prev_hash, row_id, ts, kind, job_id, payload])
    return hashlib.sha256(material.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Row:
    id: int
    ts: str
    kind: str
    job_id: str | None
    payload: dict[str, Any]
    prev_hash: str
    hash: str


@dataclass(frozen=True)
class Entry:
    """A row to append, as returned by an `update` callback."""

    kind: str
    payload: dict[str, Any] = field(default_factory=dict)
    job_id: str | None = None


def payload_of(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        # A tampered payload must not break listing; `verify` reports the row.
        return {"unparseable": text}
    return value if isinstance(value, dict) else {"value": value}


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")
