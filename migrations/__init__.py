"""Alembic migrations; installed as ``orchestrator.migrations`` and applied by the store."""
