"""A frontier run's records on disk, so a run can grow piece by piece (`--resume`).

A run folder holds `frontier.meta.json` (the protocol, fixed by the first piece, and one entry
per piece: its machine and what it added) and the calls, one JSON record per line, in
`frontier.records.jsonl` (appended as each call ends) and, once compressed for keeping,
`frontier.records.jsonl.gz`; both are read, in that order: gz first. A cell is
(configuration, temperature, item, seed): a resumed piece skips every cell already recorded,
so a killed piece loses at most the call it was making, and the report is rebuilt from the
union of all pieces' records.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

RECORDS, PACKED, META = "frontier.records.jsonl", "frontier.records.jsonl.gz", "frontier.meta.json"
# the options every piece of one run must share (the rest, e.g. which items, may change)
PROTOCOL = ("temperatures", "max_tokens", "quality", "k", "set", "seeds")


def cell(rec: dict) -> tuple:
    return rec["config"], float(rec["temperature"]), rec["workload"], rec["seed"]


def read_records(run_dir: Path) -> list[dict]:
    """Every recorded call of the run (compressed ones first), in the order written; a torn
    last line (a piece killed mid-write) is dropped."""
    out = []
    for path, opener in ((run_dir / PACKED, gzip.open), (run_dir / RECORDS, open)):
        if path.exists():
            with opener(path, "rt") as f:
                out += _parse(f.read().splitlines())
    return out


def _parse(lines: list[str]) -> list[dict]:
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return out


def recorded_cells(run_dir: Path) -> set[tuple]:
    return {cell(r) for r in read_records(run_dir)}


def read_meta(run_dir: Path) -> dict:
    path = run_dir / META
    return json.loads(path.read_text()) if path.exists() else {}


def start_piece(run_dir: Path, machine: dict, options: dict, resume: bool) -> dict:
    """Open the run for a new piece: without `resume` a fresh run (its records emptied); with
    it, the recorded protocol must equal this piece's. Returns the meta written."""
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = read_meta(run_dir) if resume else {}
    if resume:
        _drop_torn_tail(run_dir / RECORDS)
    if resume and meta:
        old = meta.get("options", {})
        for name in PROTOCOL:
            if name in old and _same(old[name]) != _same(options.get(name)):
                raise ValueError(f"--resume: {name} is {options.get(name)!r} here but "
                                 f"{old[name]!r} in {run_dir / META}; resume with the same "
                                 f"{name} or start another run folder")
    else:
        for path in (run_dir / RECORDS, run_dir / PACKED):
            path.unlink(missing_ok=True)
        meta = {"machine": machine, "options": options, "pieces": []}
    meta.setdefault("pieces", []).append({"machine": machine, "options": options,
                                          "cells_before": len(recorded_cells(run_dir))})
    (run_dir / META).write_text(json.dumps(meta, indent=1, default=str))
    return meta


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (a piece killed mid-write), so appends stay lines."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[:data.rfind(b"\n") + 1])


def _same(value):
    return json.loads(json.dumps(value, default=str))  # tuples and lists alike


def append(run_dir: Path, rec: dict) -> None:
    with (run_dir / RECORDS).open("a") as f:
        f.write(json.dumps(rec, default=str) + "\n")


def pack(run_dir: Path) -> Path:
    """Move every record into the compressed file (for committing), emptying the plain one."""
    records = read_records(run_dir)
    with gzip.open(run_dir / PACKED, "wt", compresslevel=9) as f:
        f.writelines(json.dumps(r, default=str) + "\n" for r in records)
    (run_dir / RECORDS).unlink(missing_ok=True)
    return run_dir / PACKED
