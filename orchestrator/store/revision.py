"""The schema revision this code reads and writes: the head of ``migrations/versions``
(a test keeps the two equal). Apart from ``migrate`` so that the plain-``sqlite3``
reader can check a file's revision without loading Alembic or SQLAlchemy."""

SCHEMA_REVISION = "0022"
