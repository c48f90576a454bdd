"""Mistyped commands and subcommands: refused (exit 2) with the close names suggested,
the way click suggests options, so that ``orchestrator sim`` points at ``sim-server``."""

from __future__ import annotations

import click
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.cli import main
from tests.helpers import cli


def test_a_mistyped_command_names_the_close_ones() -> None:
    shown = cli("sim")
    assert shown.returncode == 2, shown
    assert "No such command 'sim'. Did you mean 'sim-server'?" in shown.stderr, shown.stderr
    shown = cli("dataset", "delet", "x")
    assert shown.returncode == 2
    assert "No such command 'delet'. Did you mean 'delete'?" in shown.stderr, shown.stderr
    shown = cli("d")
    assert shown.returncode == 2
    assert "Did you mean one of 'dashboard', 'dataset', 'db'?" in shown.stderr, shown.stderr
    shown = cli("xyzzy")
    assert shown.returncode == 2 and "No such command 'xyzzy'." in shown.stderr
    assert "Did you mean" not in shown.stderr


def _groups() -> list[tuple[list[str], click.Group]]:
    """The command group and its subgroups, each with the words that reach it."""
    found: list[tuple[list[str], click.Group]] = [([], main)]
    found += [([n], c) for n, c in main.commands.items() if isinstance(c, click.Group)]
    return found


@st.composite
def _mistyped(draw: st.DrawFn) -> tuple[list[str], str, str]:
    """A group, one of its commands, and that name with one letter left out, or cut
    short (three letters at least)."""
    words, group = draw(st.sampled_from(_groups()))
    name = draw(st.sampled_from(sorted(n for n, c in group.commands.items() if not c.hidden)))
    if draw(st.booleans()) and len(name) > 3:
        return words, name, name[: draw(st.integers(3, len(name) - 1))]
    at = draw(st.integers(0, len(name) - 1))
    return words, name, name[:at] + name[at + 1 :]


@given(_mistyped())
def test_every_command_mistyped_or_cut_short_is_suggested(
    case: tuple[list[str], str, str],
) -> None:
    words, name, typed = case
    group = main if not words else main.commands[words[0]]
    if typed in group.commands:  # another command's name: nothing to suggest
        return
    shown = CliRunner().invoke(main, [*words, typed])
    assert shown.exit_code == 2, shown.output
    assert f"No such command {typed!r}. Did you mean" in shown.output, shown.output
    assert repr(name) in shown.output.split("Did you mean", 1)[1], shown.output
