"""The errors the orchestrator raises, in one small hierarchy.

    OrchestratorError            anything the CLI turns into a message and an exit code
    ├── InputError               a bad input file or line: names the file and line
    ├── ConfigError              an impossible option or dataset setting
    ├── StorageError             the database cannot be used (locked, full, read-only, ...)
    │   ├── SchemaError          the database schema is newer than this code, or not ours
    │   └── EmptyDatabase        no schema yet, nothing enqueued: only ``enqueue`` (or
    │                            ``db upgrade``) may use it, and ``doctor`` just says so
    ├── RunStopped               ``run`` ended with its work not done (see its subclasses)
    │   ├── ServersUnreachable   no server answered within ``--give-up-after`` (exit 4)
    │   ├── RunHalted            a setting is wrong for every request: the circuit breaker
    │   │                        stopped the run and gave the items their attempts back (5)
    │   ├── ItemsFailed          ``--exit-when-done``: finished, some items failed (6)
    │   ├── ItemsLeftPending     ``--exit-when-done``: finished, items of paused datasets
    │                            are still pending (7)
    │   ├── ServersLost          ``--launch``: no launched server started, or every one
    │                            died too often and was given up on (8)
    │   └── BudgetSpent          ``--budget``: the money left pays for no more items; the
    │                            work in flight was written, the rest left pending (9)
    └── InferenceError           an inference request did not give a usable answer
        ├── PermanentError       the server rejected the request (400, 401, 403, 404, 422):
        │                        retrying cannot help, the item fails at once
        └── TransientError       timeouts, resets, 429, 500, unparsable bodies: retry later
            ├── ServerUnavailable  the server cannot be reached or is restarting (refused
            │                    connections, 502/503/504): the worker pauses and the
            │                    item's attempt is given back
            └── BatchUnanswered  a provider's batch ended without answering the request
                                 (expired, cancelled, lost): asked again in another batch

Each inference error carries an ``error_class``: a short stable name that is stored with
the item, counted by ``status`` and selected by ``requeue --error-class``.
"""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base class; ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class InputError(OrchestratorError):
    """A bad input file: the message names ``FILE:LINE`` where it can, or ``FILE:row N``
    for a row of a table (Parquet, CSV, Arrow), whose rows are not lines."""

    exit_code = 2

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        row: int | None = None,
    ):
        self.path = path
        self.line = line
        self.row = row
        self.reason = message
        where = path if line is None else f"{path}:{line}"
        if row is not None:
            where = f"{path}:row {row}"
        super().__init__(f"{where}: {message}" if where else message)


class ConfigError(OrchestratorError):
    """Options that cannot work together, or a setting out of range."""

    exit_code = 2


class StorageError(OrchestratorError):
    """The database refused, or cannot be opened as the command needs."""

    exit_code = 3


class SchemaError(StorageError):
    pass


class EmptyDatabase(StorageError):
    """A database without the schema and without anything else in it (a 0-byte file)."""


class RunStopped(OrchestratorError):
    """``run`` ended without doing all of its work; the message is its one-line summary."""


class ServersUnreachable(RunStopped):
    exit_code = 4


class RunHalted(RunStopped):
    exit_code = 5


class ItemsFailed(RunStopped):
    """A run to the end left failed items (``requeue`` sends them back)."""

    exit_code = 6


class ItemsLeftPending(RunStopped):
    """A run to the end left items pending in paused datasets."""

    exit_code = 7


class ServersLost(RunStopped):
    """The servers the run launched could not start, or all died too often: the command,
    the model or the machine needs a look (the servers' last log lines say which)."""

    exit_code = 8


class BudgetSpent(RunStopped):
    """The run spent what its budget allows (``run --budget``): nothing more is claimed,
    the items not claimed stay pending, and a run with a higher budget goes on."""

    exit_code = 9


#: The exit codes a restart cannot fix, where a person has to act first: a bad option or
#: setting (2), a database that refuses (3: missing, of a newer schema, read-only, full,
#: replaced), a setting every request is refused for (5), items failed (6: requeue them)
#: or left in paused datasets (7: resume them), launched servers that would not stay up
#: (8: their logs say why), a budget spent (9: a restart would spend no more, so
#: stop at once, again and again). A service manager must not restart on
#: these (the systemd unit's ``RestartPreventExitStatus=``): a restart would refuse the
#: same way, or retry the trial items, every few seconds for ever. A crash (1, a
#: signal) and servers that stayed unreachable (4) are restarted.
NEEDS_A_PERSON: tuple[int, ...] = tuple(
    sorted(
        {
            ConfigError.exit_code,
            InputError.exit_code,
            StorageError.exit_code,
            RunHalted.exit_code,
            ItemsFailed.exit_code,
            ItemsLeftPending.exit_code,
            ServersLost.exit_code,
            BudgetSpent.exit_code,
        }
    )
)


class InferenceError(OrchestratorError):
    error_class = "error"
    #: Completion tokens the server said it generated for an answer refused anyway (a
    #: body that could not be used): GPU work thrown away. None: not said.
    generated_tokens: int | None = None

    def __init__(self, message: str, *, error_class: str | None = None):
        super().__init__(message)
        if error_class is not None:
            self.error_class = error_class


class PermanentError(InferenceError):
    error_class = "rejected"


class TransientError(InferenceError):
    error_class = "transient"

    def __init__(
        self, message: str, *, error_class: str | None = None, retry_after: float | None = None
    ):
        super().__init__(message, error_class=error_class)
        self.retry_after = retry_after
        #: A 429's ``x-ratelimit-*`` headers, if any
        #: (``orchestrator.inference.failures.RateLimits``).
        self.rate_limits: object | None = None


class ServerUnavailable(TransientError):
    error_class = "unavailable"


class BatchUnanswered(TransientError):
    """A provider's batch ended without answering a request. ``released``: no fault of
    the item's (the batch expired or was cancelled), its attempt given back; else (the
    batch failed, or was lost with its answers) the attempt counts, so that a provider
    that keeps failing cannot keep an item for ever."""

    error_class = "batch_unanswered"

    def __init__(
        self, message: str, *, released: bool = True, retry_after: float | None = None
    ) -> None:
        super().__init__(message, retry_after=retry_after)
        self.released = released
