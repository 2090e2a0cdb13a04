"""MkDocs hook: the reference pages, generated at build time from the code so that they cannot drift from it.

- ``reference/cli.md``: every ``qwenvl-prep`` subcommand's ``--help``, from ``qwenvl_prep.cli.build_parser``.
- ``reference/yaml-keys.md``: every YAML key the plugin adds to LLaMA-Factory, from the dataclass fields (type,
  default, help) of the argument classes the import hook installs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing

from mkdocs.structure.files import File, Files

WIDTH = "110"  # argparse wraps help to $COLUMNS


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise RuntimeError("qwenvl-prep's parser has no subcommands: the CLI reference cannot be generated")


def cli_page() -> str:
    from qwenvl_prep.cli import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parser = build_parser()
        parser.prog = "qwenvl-prep"
        parts = ["# `qwenvl-prep` command reference", "",
                 "Generated from the command's own parser at every docs build (`docs/hooks/reference.py`); "
                 "`qwenvl-prep COMMAND --help` prints the same.", "", "```text", parser.format_help().rstrip(), "```"]
        for name, sub in _subcommands(parser).items():
            sub.prog = f"qwenvl-prep {name}"
            parts += ["", f"## `{name}`", "", "```text", sub.format_help().rstrip(), "```"]
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(parts) + "\n"


def _added_fields(patched: type) -> list[dataclasses.Field]:
    """The fields the plugin's class adds to the LF dataclass it extends."""
    base = {field.name for field in dataclasses.fields(patched.__mro__[1])}
    return [field for field in dataclasses.fields(patched) if field.name not in base]


def _type_name(annotation: typing.Any) -> str:
    return str(annotation).replace("typing.", "").removeprefix("<class '").removesuffix("'>")


def _default(field: dataclasses.Field) -> str:
    value = field.default
    if value is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    return "`None`" if value is None else f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _table(fields: list[dataclasses.Field]) -> list[str]:
    rows = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for field in fields:
        help_text = " ".join(field.metadata.get("help", "").split()).replace("|", "\\|")
        kind = _type_name(field.type).replace("|", "\\|")
        rows.append(f"| `{field.name}` | `{kind}` | {_default(field)} | {help_text} |")
    return rows


def yaml_keys_page() -> str:
    from llamafactory.hparams import parser as lf_parser

    from llamafactory_qwenvl_patch.integration.lf_patch import patch_parser

    patch_parser(lf_parser)  # what the import hook does; a no-op when it already has
    model_args, finetuning = (next(cls for cls in lf_parser._TRAIN_ARGS if cls.__name__ == name)
                              for name in ("ModelArguments", "FinetuningArguments"))
    model_fields = _added_fields(model_args)
    if not any(field.name == "qwenvl_patch" for field in model_fields):
        raise RuntimeError("LLaMA-Factory's ModelArguments has no qwenvl_patch: the plugin's hook did not apply")
    parts = ["# YAML keys the plugin adds", "",
             "Generated from the plugin's argument dataclasses at every docs build (`docs/hooks/reference.py`). "
             "They sit beside LLaMA-Factory's own keys in a stock `llamafactory-cli` YAML; the frame itself is "
             "LLaMA-Factory's `image_min_pixels` / `image_max_pixels`, pinned by `qwenvl_patch: true`.", "",
             "## Model arguments (training, export, chat and API)", "", *_table(model_fields), "",
             "## `stage: grpo` arguments", "",
             "`stage` also takes `grpo`. Read strictly: each key as its declared type and range (a string for a "
             "number or a boolean is refused).", "", *_table(_added_fields(finetuning))]
    return "\n".join(parts) + "\n"


def on_files(files: Files, config: typing.Any) -> Files:
    for path, render in (("reference/cli.md", cli_page), ("reference/yaml-keys.md", yaml_keys_page)):
        files.append(File.generated(config, path, content=render()))
    return files
