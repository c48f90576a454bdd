"""The Python API's arguments checked and converted: names and flags as the command takes
them, the request body, the export options, the launch plan and the run's
configuration.

Apart from the calls themselves so that each call reads as what it does, and every
argument goes through the rules of ``orchestrator.settings.checks`` the command's
options follow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from orchestrator.api.datasets import check_body
from orchestrator.api.enqueue import request_body
from orchestrator.api.running import configs, without_credentials
from orchestrator.errors import ConfigError
from orchestrator.formats.options import ExportOptions
from orchestrator.items.quality import parse_flags
from orchestrator.items.structured import response_format_for
from orchestrator.settings.checks import (
    PATH,
    Integer,
    Names,
    Number,
    OrNone,
    PathName,
    Text,
    checked,
)

if TYPE_CHECKING:
    from orchestrator.store import Database

DB = OrNone(PathName("a path or a database URL"))
DATASETS = Names("a dataset name")
FLAGS = Names("a quality flag name")
SERVER_URLS = Names("a server URL")
LAUNCH = Names("a server command")


def enqueue_body(
    params: dict[str, Any] | None,
    model: str | None,
    named: dict[str, Any],
    json_schema: dict[str, Any] | None,
) -> dict[str, Any]:
    """The dataset's request body, checked; a schema becomes its ``response_format``."""
    body = request_body(params, model=model, **named)
    check_body(body, {"model": model, **named})
    if json_schema is not None:
        body["response_format"] = response_format_for(json_schema, source="json_schema")
    return body


def listed(name: str, value: str | Sequence[str], rule: Names) -> tuple[str, ...]:
    """One name or several, as a tuple; a lone string is one name, not its letters."""
    checked(name, value, rule)
    return (value,) if isinstance(value, str) else tuple(value)


def flag_mask(name: str, value: str | Sequence[str]) -> int:
    mask = 0
    for spec in listed(name, value, FLAGS):
        try:
            mask |= parse_flags(spec)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    return mask


def export_options(
    fmt: str, reasoning: str, exclude_flags: str | Sequence[str], provenance: bool, **more: Any
) -> ExportOptions:
    mask = flag_mask("exclude_flags", exclude_flags)
    return ExportOptions(
        format=fmt, reasoning=reasoning, exclude_flags=mask, provenance=provenance, **more
    )


def run_cap(concurrency: int | str) -> int | str:
    """``"8"`` and ``"auto"`` as the command's option takes them; anything else is left
    to ``RunSettings``' rule, which says what it must be."""
    from orchestrator.inference.servers_file import parse_cap  # lazy: aiohttp

    if isinstance(concurrency, str):
        with contextlib.suppress(ValueError):
            return parse_cap(concurrency)
    return concurrency


def launch_plan(given: dict[str, Any]) -> Any:
    """The launch arguments of a ``run`` call as the command's ``LaunchPlan``."""
    from orchestrator.inference.launch.plan import LaunchPlan  # lazy: aiohttp

    names = {f.name for f in fields(LaunchPlan)} - {"file_launches"}
    plan = {name: given[name] for name in names if name in given}
    plan["launch"] = listed("launch", given["launch"], LAUNCH)
    return LaunchPlan(**plan)


def launch_supervisor(plan: Any, database: Database) -> Any:
    """The supervisor of the servers ``run(launch=...)`` starts; None without any."""
    from orchestrator.inference.launch.plan import supervisor  # lazy: aiohttp

    checked("launch", tuple(plan.launch), LAUNCH)
    for name, value in (("replicas", plan.replicas), ("gpus_per_server", plan.gpus_per_server)):
        checked(name, value, OrNone(Integer(1)))
    checked("startup_timeout", plan.startup_timeout, Number(0, above=True))
    checked("launch_dir", plan.launch_dir, OrNone(PATH))
    path = str(database.url.database) if database.is_sqlite and database.url.database else None
    return supervisor(plan, path, source="launch")


def run_configs(
    servers: Sequence[str], api_key: str | None, settings: Any, launched: Sequence[Any] = ()
) -> tuple[Any, Any]:
    """The worker's and the client's configuration as the command makes them, from the
    servers as given (each through the check of every server source) and those the
    run launches."""
    from orchestrator._util.urls import api_key as checked_key  # lazy: aiohttp
    from orchestrator.inference.servers_file import ServerSpec, check_server_url  # lazy: aiohttp

    urls = listed("servers", servers, SERVER_URLS)
    checked("api_key", api_key, OrNone(Text()))
    if not urls and not launched:
        raise ConfigError("run needs at least one server URL (servers=[...]) or launch=[...]")
    specs = [ServerSpec(check_server_url(url, "servers")[0]) for url in urls]
    specs += list(launched)
    key = checked_key(api_key, "api_key")
    specs, auth = without_credentials(specs, key)
    return configs(specs, auth, key, settings)
