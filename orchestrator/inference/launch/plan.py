"""What a run launches, said once: the command's launch options and ``Queue.run``'s
launch arguments are the same :class:`LaunchPlan`, made into a supervisor here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError
from orchestrator.inference.launch.spec import Preset, SuperviseSettings, build_specs
from orchestrator.inference.launch.state import default_dir
from orchestrator.inference.launch.supervisor import Supervisor


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """Servers to start: commands with ``{port}``, or an engine preset (``engine``,
    ``engine_model``, ...), on ``replicas`` copies or one per ``gpus_per_server`` GPUs;
    and how they are supervised (startup time, restarts, when to give up)."""

    launch: Sequence[str] = ()
    engine: str | None = None
    engine_model: str | None = None
    tp: int = 1
    engine_args: str = ""
    engine_bin: str | None = None
    served_model_name: str | None = None
    gpus_per_server: int | None = None
    replicas: int | None = None
    startup_timeout: float = 1800.0
    restart_backoff: float = 5.0
    max_server_deaths: int = 5
    server_death_window: float = 3600.0
    launch_dir: str | None = None
    file_launches: Sequence[Any] = field(default=())  # a servers file's ``launch`` lines

    def preset(self) -> Preset | None:
        """The engine preset, or None; its options without ``engine`` are refused."""
        if self.engine:
            if not self.engine_model:
                raise ConfigError("--engine needs --model PATH")
            return Preset(
                self.engine,  # type: ignore[arg-type]
                self.engine_model,
                self.tp,
                self.engine_args,
                self.engine_bin,
                self.served_model_name,
            )
        if self.engine_model or self.engine_args or self.engine_bin or self.tp != 1:
            raise ConfigError("--model, --tp, --engine-args and --engine-bin go with --engine")
        return None

    def supervise(self) -> SuperviseSettings:
        return SuperviseSettings(
            startup_timeout=self.startup_timeout,
            restart_backoff=self.restart_backoff,
            max_deaths=self.max_server_deaths,
            death_window=self.server_death_window,
        )


def supervisor(
    plan: LaunchPlan, db_path: str | None, *, source: str = "--launch"
) -> Supervisor | None:
    """The supervisor of what ``plan`` launches (logs and state beside the SQLite
    database at ``db_path``, unless ``launch_dir``); None when it launches nothing."""
    preset = plan.preset()
    commands = [(cmd, None, None) for cmd in plan.launch]
    commands += [(ln.command, ln.concurrency, ln.port) for ln in plan.file_launches]
    specs = build_specs(commands, preset, source=source,
                        gpus_per_server=plan.gpus_per_server, replicas=plan.replicas)  # fmt: skip
    if not specs:
        return None
    base = Path(plan.launch_dir) if plan.launch_dir is not None else default_dir(db_path)
    return Supervisor(specs, plan.supervise(), base)
