"""The ledger: append-only hash chain, head file, migrations, threads and processes, and tampering with the
real `sqlite3` CLI (edit, delete a middle row, reorder, cut the tail) found by `verify`."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from proctor.mechanisms.ledger.migrations import MIGRATIONS
from proctor.mechanisms.ledger.rows import GENESIS, Entry, row_hash
from proctor.mechanisms.ledger.store import LEDGER_FILE, Ledger, LedgerTampered

SQLITE3 = shutil.which("sqlite3")
needs_sqlite3 = pytest.mark.skipif(SQLITE3 is None, reason="the sqlite3 CLI is not installed (apt-get install sqlite3)")
UNGUARD = "DROP TRIGGER rows_no_update; DROP TRIGGER rows_no_delete;"


@pytest.fixture(autouse=True)
def home(fresh_home: Path) -> Path:
    return fresh_home


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "l" / LEDGER_FILE) as led:
        yield led


def fill(led: Ledger, n: int = 5) -> None:
    for i in range(1, n + 1):
        led.append("job.start" if i % 2 else "gate.decision", {"i": i, "text": f"row {i}"}, job_id=f"j{i % 2}")


def sql(led: Ledger, script: str) -> None:
    subprocess.run([SQLITE3, str(led.path), script], check=True, capture_output=True, text=True)


def test_append_rows_and_filters(ledger):
    assert ledger.append("a", {"x": 1}) == 1
    assert ledger.append("b", {"y": [1, 2]}, job_id="j") == 2
    assert ledger.append("a", {"z": "é"}, job_id="j") == 3
    assert [r.id for r in ledger.rows()] == [1, 2, 3]
    assert [r.id for r in ledger.rows(kind="a")] == [1, 3]
    assert [r.id for r in ledger.rows(job_id="j")] == [2, 3]
    assert [r.id for r in ledger.rows(kind="a", job_id="j")] == [3]
    rows = ledger.rows()
    assert rows[0].prev_hash == GENESIS and rows[1].prev_hash == rows[0].hash
    assert rows[2].payload == {"z": "é"} and ledger.verify() == []


def test_default_path_under_proctor_home(home):
    with Ledger.default() as led:
        assert led.path == home / "ledger.sqlite3" and led.head_path == home / "ledger.head"
        led.append("x", {})
    assert (home / "ledger.head").exists()
    mode = sqlite3.connect(home / "ledger.sqlite3").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_migrations_applied_once_and_recorded(tmp_path):
    path = tmp_path / LEDGER_FILE
    with Ledger(path) as led:
        first = led.migrations()
        led.append("x", {})
    with Ledger(path) as led:
        assert led.migrations() == first == [m.__name__ for m in MIGRATIONS]
        assert [r.id for r in led.rows()] == [1]


def test_unserialisable_payload_is_refused_and_leaves_chain_intact(ledger):
    ledger.append("ok", {"a": 1})
    with pytest.raises((TypeError, ValueError)):
        ledger.append("bad", {"a": object()})
    with pytest.raises(ValueError):
        ledger.append("bad", {"a": float("nan")})
    assert ledger.append("ok", {"a": 2}) == 2 and ledger.verify() == []


def test_update_rolls_back_state_and_rows_together(ledger):
    ledger.append("ok", {})

    def broken(db):
        db.execute("INSERT INTO breaker VALUES ('x', 'open', 1, NULL, NULL, NULL)")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        ledger.update(broken)
    assert ledger.read(lambda db: db.execute("SELECT count(*) FROM breaker").fetchone()[0]) == 0
    assert ledger.update(lambda db: ("r", [Entry("a", {}), Entry("b", {"k": 1}, "j")])) == ("r", [2, 3])
    assert ledger.verify() == []


def test_triggers_refuse_update_and_delete(ledger):
    fill(ledger, 2)
    db = sqlite3.connect(ledger.path)
    for stmt in ("UPDATE rows SET payload = '{}' WHERE id = 1", "DELETE FROM rows WHERE id = 2"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            db.execute(stmt)
    db.close()
    assert ledger.verify() == []


def test_threads_share_one_ledger(ledger):
    def work(t: int) -> None:
        for i in range(40):
            ledger.append("t", {"t": t, "i": i})

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(ledger.rows()) == 160 and ledger.verify() == []


def test_processes_share_one_file(tmp_path):
    path = tmp_path / LEDGER_FILE
    code = ("import sys; from proctor.mechanisms.ledger.store import Ledger\n"
            "led = Ledger(sys.argv[1])\n"
            "[led.append('p', {'pid': sys.argv[2], 'i': i}) for i in range(30)]\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), str(n)]) for n in range(3)]
    with Ledger(path) as led:
        for i in range(30):
            led.append("p", {"pid": "parent", "i": i})
        assert all(p.wait(timeout=60) == 0 for p in procs)
        assert len(led.rows()) == 120 and led.verify() == []


# --- tampering with the real sqlite3 CLI; each beside a control that verifies clean -----------------------

@needs_sqlite3
def test_control_readonly_cli_use_is_clean(ledger):
    fill(ledger)
    out = subprocess.run([SQLITE3, str(ledger.path), "SELECT count(*) FROM rows;"], capture_output=True, text=True)
    assert out.stdout.strip() == "5" and ledger.verify() == []


@needs_sqlite3
def test_cli_edit_payload_detected(ledger):
    fill(ledger)
    sql(ledger, UNGUARD + """UPDATE rows SET payload = '{"i":3,"text":"forged"}' WHERE id = 3;""")
    problems = ledger.verify()
    assert problems[0].startswith("row 3:") and "edited" in problems[0]


@needs_sqlite3
def test_cli_edit_with_recomputed_hash_breaks_next_link(ledger):
    fill(ledger)
    # A forger who edits row 3 and re-hashes it correctly still cannot make row 4 point at it.
    row = ledger.rows()[2]
    forged = '{"i":3,"text":"forged"}'
    digest = row_hash(row.prev_hash, row.id, row.ts, row.kind, row.job_id, forged)
    sql(ledger, UNGUARD + f"UPDATE rows SET payload = '{forged}', hash = '{digest}' WHERE id = 3;")
    assert ledger.verify()[0].startswith("row 4: chain broken")


@needs_sqlite3
def test_cli_delete_middle_row_detected(ledger):
    fill(ledger)
    sql(ledger, UNGUARD + "DELETE FROM rows WHERE id = 3;")
    assert ledger.verify()[0].startswith("row 3: missing")


@needs_sqlite3
def test_cli_reorder_detected(ledger):
    fill(ledger)
    # Swap rows 2 and 4 by renumbering: every column intact, only the order changed.
    sql(ledger, UNGUARD + "UPDATE rows SET id = 100 WHERE id = 2; UPDATE rows SET id = 2 WHERE id = 4;"
                          " UPDATE rows SET id = 4 WHERE id = 100;")
    assert [r.id for r in ledger.rows()] == [1, 2, 3, 4, 5]
    assert ledger.verify()[0].startswith("row 2:")


@needs_sqlite3
def test_cli_truncate_tail_detected(ledger):
    fill(ledger)
    sql(ledger, UNGUARD + "DELETE FROM rows WHERE id >= 4;")
    problems = ledger.verify()
    assert problems[0].startswith("row 4: missing") and "tail was cut" in problems[0]


@needs_sqlite3
def test_cli_dropped_triggers_alone_reported(ledger):
    fill(ledger)
    sql(ledger, UNGUARD)
    assert ledger.verify() == ["ledger: append-only triggers removed: rows_no_delete, rows_no_update"]


def test_head_missing_or_edited_detected(ledger):
    fill(ledger, 3)
    head = ledger.head_path.read_text()
    ledger.head_path.write_text(head.replace('"id":3', '"id":2'))
    assert ledger.verify()[0].startswith("row 2: does not match")
    ledger.head_path.unlink()
    assert ledger.verify()[0].startswith("row 3:") and "missing" in ledger.verify()[0]
    ledger.head_path.write_text(head)  # control: the real head restores a clean verify
    assert ledger.verify() == []


def test_row_appended_outside_proctor_detected(ledger):
    fill(ledger, 2)
    db = sqlite3.connect(ledger.path)
    db.execute("INSERT INTO rows VALUES (3, 'ts', 'forged', NULL, '{}', ?, 'x')", (ledger.rows()[-1].hash,))
    db.commit()
    db.close()
    assert ledger.verify()[0].startswith("row 3:")


def test_closed_ledger_refuses(tmp_path):
    led = Ledger(tmp_path / LEDGER_FILE)
    led.close()
    led.close()
    with pytest.raises(ValueError, match="closed"):
        led.append("x", {})


KILLED_MID_APPEND = """
import os, sys
from proctor.mechanisms.ledger import store as L
real = os.replace
def replace(src, dst):
    real(src, dst)
    if str(dst).endswith("ledger.head"):
        os._exit(9)  # killed between swapping the new head in and the commit
os.replace = replace
L.Ledger(sys.argv[1]).append("job.start", {"n": 99})
"""


def test_a_writer_killed_between_its_head_swap_and_its_commit_is_not_a_cut_tail(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    with Ledger(path) as led:
        for i in range(3):
            led.append("job.start", {"n": i})
    p = subprocess.run([sys.executable, "-c", KILLED_MID_APPEND, str(path)], capture_output=True, text=True)
    assert p.returncode == 9, p.stderr
    staged = [t.name for t in tmp_path.iterdir() if t.name.endswith(".old.tmp")]
    assert staged, "the killed writer should have left its staged old head"
    head = json.loads((tmp_path / "ledger.head").read_text())
    assert head["id"] == 4  # the head names the row that never committed
    with Ledger(path) as led:  # the next open puts the old head back
        assert led.verify() == [] and [r.payload["n"] for r in led.rows()] == [0, 1, 2]
        led.append("job.start", {"n": 3})
        assert led.verify() == []
    assert not [t for t in tmp_path.iterdir() if t.name.endswith(".tmp")]


def test_a_head_ahead_of_the_rows_without_a_dead_writers_trace_is_still_a_cut_tail(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    with Ledger(path) as led:
        for i in range(3):
            led.append("job.start", {"n": i})
        last = led.rows()[-1]
    (tmp_path / "ledger.head").write_text(json.dumps({"id": last.id + 1, "hash": "f" * 64}) + "\n")
    with Ledger(path) as led:
        problems = led.verify()
    assert problems and "tail was cut" in problems[0]


def test_every_writer_of_an_open_is_refused_once_its_chain_is_found_broken(tmp_path):
    path = tmp_path / LEDGER_FILE
    with Ledger(path) as led:
        for i in range(3):
            led.append("gate.decision", {"n": i})
    with Ledger(path) as control:  # an intact chain: a new open writes
        control.append("gate.decision", {"n": 3})
    with sqlite3.connect(path) as db:
        db.execute("DROP TRIGGER rows_no_update")
        db.execute("UPDATE rows SET payload = ? WHERE id = 2", ('{"n":"edited"}',))
    with Ledger(path) as led:
        # The gate's, the listener's, the breaker's rows: none is chained onto the edited row.
        with pytest.raises(LedgerTampered, match="row 2"):
            led.append("gate.decision", {"n": 4})
        with pytest.raises(LedgerTampered):
            led.append("queue.start", {"n": 5})
        assert len(led.rows()) == 4
