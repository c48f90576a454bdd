"""``run --budget``: when the money left pays for no more items, and what the run says.

Each claim reads the ledger (``store.spend``) in its own transaction and takes no more
items than the money left pays for at the mean billed per request so far, counting every
item running; this module turns the last such finding into the run's end: once the
money left pays for nothing more and nothing is running, the worker stops with
``BudgetSpent`` (exit 9). The items not claimed stay pending, nothing is lost.
"""

from __future__ import annotations

import structlog

from orchestrator.errors import BudgetSpent
from orchestrator.store.spend import Budget, Standing
from orchestrator.worker.config import WorkerConfig

log = structlog.get_logger("orchestrator.worker")


def of(config: WorkerConfig) -> Budget | None:
    """The claims' budget, None without one."""
    if config.budget is None or config.prices is None:
        return None
    return Budget(config.budget, config.prices, config.datasets)


def spent(budget: Budget | None) -> Standing | None:
    """The finding that ends the run: the last claim found room for nothing with no
    item running anywhere (no answer to come can lower the mean); else None."""
    last = budget.last if budget is not None else None
    if last is None or last.room > 0 or last.running > 0:
        return None
    return last


def stopped(standing: Standing, left: int) -> BudgetSpent:
    """The run's last line: what was spent, the budget, the items left and how to go on."""
    per = standing.per_request
    rate = f" (at ${per:,.4f} a request billed so far)" if per is not None else ""
    more = standing.spent + left * per if per is not None else standing.limit * 2
    log.warning(
        "budget_spent",
        spent_usd=round(standing.spent, 4),
        budget_usd=standing.limit,
        per_request_usd=None if per is None else round(per, 6),
        items_left=left,
    )
    return BudgetSpent(
        f"budget spent: ${standing.spent:,.2f} of the ${standing.limit:,.2f} budget{rate}; "
        f"{left:,} items left pending, none lost: run again with a higher --budget "
        f"(say --budget {max(more, standing.limit) + 0.005:.2f}) to go on"
    )
