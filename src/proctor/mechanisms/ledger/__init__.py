"""The ledger: one append-only, hash-chained SQLite file under $PROCTOR_HOME.

Owns rows, their chain and head file, migrations and the disk reserve; it never decides what a row means.
"""
