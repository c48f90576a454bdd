"""The Python API: the queue from a program or a notebook, with the command's behaviour.

Every call goes through the same functions the ``orchestrator`` command uses
(``orchestrator.api.enqueue``, ``orchestrator.api.running``, the store, the exporters), so a
dataset enqueued here is the dataset ``orchestrator enqueue`` would have made, and
errors are the ``orchestrator.errors`` tree with the same file:line messages.

Options are keyword-only, so that new ones (sources, samples per prompt, run-order
policies) can be added without breaking a call. Every argument is checked before anything
is read or written, by the rules of ``orchestrator.settings.checks`` that the command's options
follow too: a wrong type or an impossible value is a ``ConfigError`` naming the argument
and what it got. docs/API.md shows it in use.
"""

from orchestrator.api.async_queue import Queue, open
from orchestrator.api.results import Status
from orchestrator.api.running import RunOutcome
from orchestrator.api.sync_queue import SyncQueue, open_sync

__all__ = ["Queue", "RunOutcome", "Status", "SyncQueue", "open", "open_sync"]
