"""What to launch: command lines (given, or built by an engine preset), replicas over the
machine's GPUs, and the supervision settings. Pure: nothing here starts a process."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from orchestrator.errors import ConfigError
from orchestrator.inference.servers_file import PORT, Cap, check_command

ENGINES = ("sglang", "vllm", "llama.cpp")
Engine = Literal["sglang", "vllm", "llama.cpp"]


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """One server to launch: its command (with ``{port}``), its cap, its environment
    (``CUDA_VISIBLE_DEVICES`` for a replica), and a fixed port if it must have one."""

    command: str
    concurrency: Cap | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    port: int | None = None

    def argv(self, port: int) -> list[str]:
        """The command's words with the port put in."""
        return [word.replace(PORT, str(port)) for word in shlex.split(self.command)]


@dataclass(frozen=True, slots=True)
class Preset:
    """``--engine`` and its options: the command line of a known server."""

    engine: Engine
    model: str
    tp: int = 1
    engine_args: str = ""
    program: str | None = None  # the engine's executable, if not the usual one on PATH
    served_model_name: str | None = None


def preset_command(preset: Preset) -> str:
    """The engine's command line, with the flags this job needs spelled out: loopback
    only, the picked port, tensor parallelism, and metrics on (``--concurrency auto``
    reads them). vLLM serves ``/metrics`` without being asked."""
    model = shlex.quote(preset.model)
    name = preset.served_model_name
    quoted = shlex.quote(name) if name else None
    if preset.engine == "sglang":
        program = preset.program or "python"
        parts = [f"{shlex.quote(program)} -m sglang.launch_server --model-path {model}",
                 "--host 127.0.0.1 --port {port}", f"--tp-size {preset.tp}",
                 "--enable-metrics"]  # fmt: skip
        if quoted:
            parts.append(f"--served-model-name {quoted}")
    elif preset.engine == "vllm":
        program = preset.program or "vllm"
        parts = [f"{shlex.quote(program)} serve {model}", "--host 127.0.0.1 --port {port}",
                 f"--tensor-parallel-size {preset.tp}"]  # fmt: skip
        if quoted:
            parts.append(f"--served-model-name {quoted}")
    elif preset.engine == "llama.cpp":
        if preset.tp != 1:
            raise ConfigError(
                "--tp is not for llama.cpp: it splits a model over GPUs by itself "
                "(pass --split-mode or --tensor-split in --engine-args)"
            )
        program = preset.program or "llama-server"
        parts = [f"{shlex.quote(program)} -m {model}", "--host 127.0.0.1 --port {port}",
                 "--metrics"]  # fmt: skip
        if quoted:
            parts.append(f"--alias {quoted}")
    else:
        raise ConfigError(f"unknown engine {preset.engine!r}; expected one of {ENGINES}")
    if preset.engine_args.strip():
        try:
            extra = shlex.split(preset.engine_args)
        except ValueError as exc:
            raise ConfigError(f"--engine-args: {exc}") from None
        parts.append(shlex.join(extra))
    return " ".join(parts)


def detect_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when it is set (as the
    scheduler left it), else what ``nvidia-smi -L`` lists, else none."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        # CUDA stops at the first invalid id: "-1" (or "") hides every GPU.
        valid = []
        for gpu in ids:
            if gpu.startswith("-"):
                break
            valid.append(gpu)
        return valid
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if listed.returncode != 0:
        return []
    return [str(n) for n, line in enumerate(listed.stdout.splitlines()) if line.startswith("GPU ")]


def replicate(
    specs: Sequence[LaunchSpec],
    *,
    gpus_per_server: int | None = None,
    replicas: int | None = None,
    gpus: Sequence[str] | None = None,
) -> list[LaunchSpec]:
    """Each command as many times as asked: ``replicas`` copies (CPU engines), or one
    per ``gpus_per_server`` of the GPUs, each with its own ``CUDA_VISIBLE_DEVICES``.

    With several commands and GPUs, the GPUs are shared out in the commands' order.
    """
    if gpus_per_server is not None and replicas is not None:
        raise ConfigError("give --gpus-per-server or --replicas, not both")
    if gpus_per_server is None:
        copies = replicas or 1
        if copies < 1:
            raise ConfigError("--replicas must be at least 1")
        if copies > 1 and any(spec.port for spec in specs):
            raise ConfigError("a launch line with a fixed port= cannot have replicas")
        return [spec for spec in specs for _ in range(copies)]
    if gpus_per_server < 1:
        raise ConfigError("--gpus-per-server must be at least 1")
    found = list(detect_gpus() if gpus is None else gpus)
    groups = len(found) // gpus_per_server
    if groups < len(specs):
        raise ConfigError(
            f"--gpus-per-server {gpus_per_server}: {len(found)} GPU(s) found "
            f"({','.join(found) or 'none'}; from CUDA_VISIBLE_DEVICES or nvidia-smi -L), "
            f"too few for {len(specs)} command(s)"
        )
    out: list[LaunchSpec] = []
    for n in range(groups):
        spec = specs[n % len(specs)]
        devices = ",".join(found[n * gpus_per_server : (n + 1) * gpus_per_server])
        env = {**spec.env, "CUDA_VISIBLE_DEVICES": devices}
        out.append(LaunchSpec(spec.command, spec.concurrency, env, spec.port))
    return out


@dataclass(frozen=True, slots=True)
class SuperviseSettings:
    """How launched servers are watched. Defaults suit a large model on GPUs: loading
    600 GB of weights takes many minutes, a wedged server is given a minute and a half.

    ``startup_timeout``: seconds a server may take to answer ``/health`` and
    ``/v1/models`` (at the first start and after each restart).
    ``health_every`` / ``health_timeout`` / ``health_misses``: a running server that
    misses that many looks at ``/health`` in a row is taken as wedged and restarted.
    ``max_deaths`` within ``death_window`` seconds: the server is given up on.
    ``restart_backoff``: the first restart's delay, doubled per death in the window,
    capped at ``restart_backoff_cap``. ``stop_timeout``: SIGTERM to SIGKILL.
    ``log_max_bytes`` / ``log_keep``: each server's log is rotated at that size, that
    many older files kept.
    """

    startup_timeout: float = 1800.0
    health_every: float = 10.0
    health_timeout: float = 30.0
    health_misses: int = 3
    max_deaths: int = 5
    death_window: float = 3600.0
    restart_backoff: float = 5.0
    restart_backoff_cap: float = 300.0
    stop_timeout: float = 30.0
    log_max_bytes: int = 64 * 2**20
    log_keep: int = 3

    def __post_init__(self) -> None:
        for name in ("startup_timeout", "health_every", "health_timeout", "stop_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be more than 0")
        if self.health_misses < 1 or self.max_deaths < 1:
            raise ConfigError("health_misses and max_deaths must be at least 1")
        if self.restart_backoff < 0 or self.death_window <= 0:
            raise ConfigError("restart_backoff must be 0 or more, death_window more than 0")


def build_specs(
    commands: Sequence[tuple[str, Cap | None, int | None]],
    preset: Preset | None = None,
    *,
    source: str = "--launch",
    gpus_per_server: int | None = None,
    replicas: int | None = None,
    gpus: Sequence[str] | None = None,
) -> list[LaunchSpec]:
    """The servers to launch: each command (checked), the preset's, then replicated."""
    specs = [LaunchSpec(check_command(c, source), cap, port=p) for c, cap, p in commands]
    if preset is not None:
        specs.append(LaunchSpec(check_command(preset_command(preset), "--engine")))
    if not specs:
        if gpus_per_server is not None or replicas is not None:
            raise ConfigError("--gpus-per-server and --replicas need --launch or --engine")
        return []
    return replicate(specs, gpus_per_server=gpus_per_server, replicas=replicas, gpus=gpus)
