"""The systemd units for workers, rendered with the paths of an installation.

This is the one place the unit text lives: ``orchestrator deploy systemd`` prints it for
the running installation, and the files in ``deploy/`` are the same text rendered with
example paths (a test keeps them in step).

Why the settings are what they are:

* ``Type=notify`` with ``NotifyAccess=main``: the unit is "started" once the worker has
  opened the database and reached a server, and ``systemctl status`` shows its progress.
* ``WatchdogSec=60``: the worker pings from its event loop; a hung loop is restarted.
* ``TimeoutStopSec=90``: longer than the default ``--grace`` of 30 s plus releasing
  the unfinished items and the final WAL checkpoint, so a stop never ends in SIGKILL.
* ``TimeoutStartSec=15min``: a worker waits for its inference server before it is ready;
  an inference server that takes longer to load fails the start, and
  ``Restart=on-failure`` tries again.
* ``RestartPreventExitStatus=``: the exit codes that need a person
  (``orchestrator.errors.NEEDS_A_PERSON``); restarting on them would refuse the same
  way, or send the trial items again, every ``RestartSec`` for ever.
* The sandbox: the worker needs to read its installation, write its database directory
  and open TCP connections. Everything else is taken away.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import NEEDS_A_PERSON, ConfigError
from orchestrator.ops.secrets import check_servers

DEFAULT_USER = "orchestrator"
DEFAULT_DB = "/var/lib/orchestrator/orchestrator.db"
CONFIG_DIR = "/etc/orchestrator"

_UNIT = """\
# {title}
# Rendered by `orchestrator deploy systemd{command_suffix}`; see deploy/README.md.
{install_hint}
[Unit]
Description=orchestrator worker{description_suffix}
After=network-online.target
Wants=network-online.target

[Service]
Type=notify
NotifyAccess=main
User={user}
Group={user}
{environment}EnvironmentFile={env_file}
WorkingDirectory={data_dir}
ExecStart={exec_start}
# The worker pings the watchdog from its event loop: a hung loop gets restarted.
WatchdogSec=60
# Ready once the database is open and a server answers; an inference server still
# loading its model for longer than this fails the start, and the restart tries again.
TimeoutStartSec=15min
# SIGTERM stops claiming and gives in-flight requests --grace (30 s by default), then
# releases the rest: the stop timeout must be longer than that.
KillSignal=SIGTERM
KillMode=mixed
TimeoutStopSec=90
Restart=on-failure
RestartSec=5
# Exit codes that need a person, not a restart: 2 a bad option or setting, 3 the
# database refused, 5 a setting every request is refused for, 6 items failed, 7 items
# left in paused datasets. A crash, a hung loop or unreachable servers (4) restart.
RestartPreventExitStatus={prevent}
UMask=0077

# Sandbox: read the installation, write the database directory, talk TCP.
NoNewPrivileges=yes
ProtectSystem=strict
ReadWritePaths={data_dir}
PrivateTmp=yes
PrivateMounts=yes
ProtectHome=yes
PrivateDevices=yes
PrivateUsers=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
# No ProtectProc=: a worker tells a dead lease holder on this host by its missing
# /proc/PID, so other users' workers must stay visible. ProcSubset=pid keeps those.
ProcSubset=pid
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
RestrictNamespaces=yes
LockPersonality=yes
MemoryDenyWriteExecute=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
RemoveIPC=yes
KeyringMode=private
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged @resources
SystemCallErrorNumber=EPERM
CapabilityBoundingSet=
AmbientCapabilities=
DevicePolicy=closed

[Install]
WantedBy=multi-user.target
"""


@dataclass(frozen=True, slots=True)
class UnitSpec:
    """What differs between installations: who runs it, where things are."""

    executable: str
    user: str = DEFAULT_USER
    db: str = DEFAULT_DB
    servers: tuple[str, ...] = ()
    template: bool = False


def installed_executable() -> str:
    """The ``orchestrator`` script of this installation (the venv's, when in one)."""
    beside = Path(sys.executable).parent / "orchestrator"
    if beside.exists():
        return str(beside)
    return shutil.which("orchestrator") or str(beside)


def sqlite_path(db: str) -> Path:
    """The absolute database file path of ``--db``; only SQLite runs as a service yet."""
    text = db
    if "://" in db:
        scheme, _, rest = db.partition("://")
        if not scheme.startswith("sqlite"):
            raise ConfigError(f"only SQLite databases are supported here, not {scheme}")
        text = rest[1:] if rest.startswith("/") else rest
        if not text:
            raise ConfigError(f"{db}: no database file in the URL")
    path = Path(text).expanduser()
    if not path.is_absolute():
        raise ConfigError(f"{db}: give an absolute path (a service has no current directory)")
    return path


def _check_value(name: str, value: str) -> None:
    if not value or any(c.isspace() or c in "\"'\\%$;" for c in value):
        raise ConfigError(f"{name} {value!r}: no spaces, quotes, '%', '$' or ';' in a unit file")


def render_unit(spec: UnitSpec) -> str:
    """The unit file text: ``orchestrator-worker.service`` or the ``@`` template."""
    db = sqlite_path(spec.db)
    check_servers(
        spec.servers,
        file="a unit file",
        advice="put USER:PASSWORD in a file readable by the service only, named by "
        f"ORCHESTRATOR_BASIC_AUTH_FILE in {CONFIG_DIR}/worker.env",
    )
    for name, value in (
        ("--user", spec.user),
        ("the orchestrator path", spec.executable),
        ("--db", str(db)),
        *(("--server", s) for s in spec.servers),
    ):
        _check_value(name, value)
    environment = f"Environment=ORCHESTRATOR_DB={db}\n"
    if spec.servers:
        environment += f'Environment="ORCHESTRATOR_SERVERS={" ".join(spec.servers)}"\n'
    if spec.template:
        title = (
            "orchestrator-worker@.service: one worker per instance, e.g. orchestrator-worker@code"
        )
        env_file = f"{CONFIG_DIR}/%i.env"  # required: an instance is its environment file
        install_hint = (
            "# Install: orchestrator deploy systemd --template > "
            "/etc/systemd/system/orchestrator-worker@.service\n"
            f"# Each instance NAME reads {CONFIG_DIR}/NAME.env (its ORCHESTRATOR_DB, servers, "
            "datasets)."
        )
        description_suffix = " %i"
        command_suffix = " --template"
    else:
        title = "orchestrator-worker.service: a worker as a hardened systemd service"
        env_file = f"-{CONFIG_DIR}/worker.env"
        install_hint = (
            "# Install: orchestrator deploy systemd > /etc/systemd/system/"
            "orchestrator-worker.service"
        )
        description_suffix = ""
        command_suffix = ""
    # $ORCHESTRATOR_RUN_ARGS (from the environment file) splits into more run options.
    exec_start = f"{spec.executable} --log-json run $ORCHESTRATOR_RUN_ARGS"
    text = _UNIT.format(
        title=title,
        command_suffix=command_suffix,
        install_hint=install_hint,
        description_suffix=description_suffix,
        user=spec.user,
        environment=environment,
        env_file=env_file,
        data_dir=db.parent,
        exec_start=exec_start,
        prevent=" ".join(str(code) for code in NEEDS_A_PERSON),
    )
    return text
