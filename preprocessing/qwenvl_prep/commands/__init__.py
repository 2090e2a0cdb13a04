"""The subcommands, one module each, named for the command (``fix-config`` -> ``fix_config``, ``eval`` ->
``evaluate``). Each holds its arguments (``add_parser``) and its handler (``run``), and imports the work it does
from ``pipeline/`` or ``demos/`` only when it runs, so ``--help`` answers fast. A new subcommand is a module here
plus its place in ``COMMANDS`` (the order ``qwenvl-prep --help`` lists them in).

May import: ``plumbing``, ``lf``, ``formats``, ``pipeline``, ``demos`` and each other; never the CLI."""

from __future__ import annotations

from qwenvl_prep.commands import (agent_eval, check, convert, curriculum, demo, draw, evaluate, fix_config, predict,
                                  tiny_model)

COMMANDS = (tiny_model, convert, curriculum, check, draw, fix_config, predict, evaluate, agent_eval, demo)
