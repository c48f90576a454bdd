"""The Python API's calls on one dataset: change its settings, delete it, bring it back.

``orchestrator.api.Queue`` and ``SyncQueue`` take them from the classes here, so that
they go through the same store functions as ``orchestrator dataset set`` and ``dataset
delete``, with the arguments checked by the rules the command's options follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from orchestrator.api.enqueue import request_body
from orchestrator.errors import ConfigError
from orchestrator.items.params import problems
from orchestrator.settings.checks import DATASET_NAME, FLAG, Names, checked
from orchestrator.store import DatasetSpec
from orchestrator.store.datasets import change_settings
from orchestrator.store.deletion import delete_dataset, purge_deleted, undo_delete

if TYPE_CHECKING:
    from orchestrator.store import Database
    from orchestrator.store.datasets import SettingsReport
    from orchestrator.store.deletion import DeletionReport

_KEYS = Names("a request parameter name")


def check_body(body: dict[str, Any], named: dict[str, Any]) -> None:
    """The request body through the check every other source gets (``orchestrator.items.params``),
    each refusal under the argument that gave it (``temperature``, ``params['n']``)."""
    found = problems(body)
    if found:
        where = [name if named.get(name) is not None else f"params[{name!r}]" for name, _ in found]
        raise ConfigError(
            "; ".join(f"{w}: {why}" for w, (_, why) in zip(where, found, strict=True))
        )


class DatasetCalls:
    """``Queue``'s calls on one dataset by name."""

    @property
    def database(self) -> Database:  # pragma: no cover - Queue's own
        raise NotImplementedError

    async def set_dataset(
        self,
        name: str,
        *,
        model: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        params: dict[str, Any] | None = None,
        unset: Sequence[str] = (),
        concurrency: int | None = None,
        priority: int | None = None,
        on_truncated: str | None = None,
        on_invalid: str | None = None,
        on_overflow: str | None = None,
        history_reasoning: str | None = None,
    ) -> SettingsReport:
        """Change the settings given of dataset ``name``, and only those, as ``orchestrator
        dataset set``: ``params`` are merged over the stored ones, ``unset`` keys
        removed. They apply to its pending items; done ones keep their answers. The
        report lists each change and the pending items it applies to."""
        checked("name", name, DATASET_NAME)
        checked("unset", unset, _KEYS)
        named = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        body = request_body(params, model=model, **named)
        check_body(body, {"model": model, **named})
        knobs = {"concurrency": concurrency, "priority": priority}
        knobs |= {"on_truncated": on_truncated, "on_invalid": on_invalid}
        knobs |= {"on_overflow": on_overflow, "history_reasoning": history_reasoning}
        spec = DatasetSpec(name=name, params=body, **knobs)
        keys = (unset,) if isinstance(unset, str) else tuple(unset)
        return await change_settings(self.database, spec, unset=keys)

    async def delete_dataset(
        self, name: str, *, dry_run: bool = False, with_outputs: bool = False
    ) -> DeletionReport:
        """Delete dataset ``name`` as ``orchestrator dataset delete``: its rows are kept
        aside until :meth:`purge_deleted`, and :meth:`undo_delete` brings them back.
        ``dry_run`` says what would go. Raises ``ConfigError`` (nothing changed) while
        items of it run, and when it holds answers unless ``with_outputs``."""
        checked("name", name, DATASET_NAME)
        checked("dry_run", dry_run, FLAG)
        checked("with_outputs", with_outputs, FLAG)
        return await delete_dataset(self.database, name, with_outputs=with_outputs, dry_run=dry_run)

    async def undo_delete(self, name: str, *, dry_run: bool = False) -> DeletionReport:
        """Bring back the latest deletion of dataset ``name``, every row as it was."""
        checked("name", name, DATASET_NAME)
        checked("dry_run", dry_run, FLAG)
        return await undo_delete(self.database, name, dry_run=dry_run)

    async def purge_deleted(self, name: str) -> int:
        """Drop for good what deleting dataset ``name`` kept aside; the deletions purged."""
        checked("name", name, DATASET_NAME)
        return await purge_deleted(self.database, name)


class SyncDatasetCalls:
    """``SyncQueue``'s blocking forms of :class:`DatasetCalls`."""

    _queue: Any

    def _call(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover
        raise NotImplementedError

    def set_dataset(self, name: str, **options: Any) -> SettingsReport:
        """``Queue.set_dataset``."""
        return self._call(self._queue.set_dataset, name, **options)  # type: ignore[no-any-return]

    def delete_dataset(self, name: str, **options: Any) -> DeletionReport:
        """``Queue.delete_dataset``."""
        return self._call(self._queue.delete_dataset, name, **options)  # type: ignore[no-any-return]

    def undo_delete(self, name: str, **options: Any) -> DeletionReport:
        """``Queue.undo_delete``."""
        return self._call(self._queue.undo_delete, name, **options)  # type: ignore[no-any-return]

    def purge_deleted(self, name: str) -> int:
        """``Queue.purge_deleted``."""
        return self._call(self._queue.purge_deleted, name)  # type: ignore[no-any-return]
