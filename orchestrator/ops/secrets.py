"""Secrets kept out of the files ``deploy`` writes: one check for every such file.

A unit file or an sbatch script is read by anyone with access to the file, the job's
record or ``ps``: a server URL with credentials, or a launch line with an API key or a
token in it, would show them. Both are refused, naming what to use instead.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable

from orchestrator._util.urls import split
from orchestrator.errors import ConfigError

# An option that takes a secret as its value (--api-key, --hf-token, --password), but
# not one that names where the secret is (--api-key-file, --token-path).
_SECRET_OPTION = re.compile(
    r"^--?[\w-]*(api[-_]?key|token|secret|passw(or)?d)(?![\w-]*(file|path|env))[\w-]*$", re.I
)
# A word that is a key whatever it follows: OpenAI's sk-..., Hugging Face's hf_...
_KEY_LIKE = re.compile(r"^(sk-|hf_)[A-Za-z0-9_-]{8,}$")


def check_servers(servers: Iterable[str], *, file: str, advice: str) -> None:
    """Refuse a server URL holding credentials: ``file`` would show them."""
    for server in servers:
        shown, auth = split(server, "--server")
        if auth is not None:
            raise ConfigError(
                f"--server {shown}: its URL holds credentials, which {file} would show to "
                f"anyone who can read it; give the URL without them and {advice}"
            )


def secret_in(command: str) -> str | None:
    """The option (or the key-like word, masked) that puts a secret in ``command``."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    for at, word in enumerate(words):
        name, eq, value = word.partition("=")
        if _SECRET_OPTION.match(name) and (value if eq else at + 1 < len(words)):
            return name
        if _KEY_LIKE.match(value if eq else word):
            return f"{(value if eq else word)[:3]}..."
    return None


def check_commands(commands: Iterable[tuple[str, str]], *, file: str, advice: str) -> None:
    """Refuse a command line (``(option, text)``, as ``--launch`` or ``--run-args``
    gave it) holding a secret: ``file`` would show it. The message does not repeat it."""
    for option, text in commands:
        found = secret_in(text)
        if found is not None:
            raise ConfigError(
                f"{option}: it holds a secret ({found}), which {file} would show to anyone "
                f"who can read it; {advice}"
            )
