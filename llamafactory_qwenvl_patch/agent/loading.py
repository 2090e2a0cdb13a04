"""User code named in a YAML as ``package.module:name`` or ``path/to/file.py:name``: importing its module with named
errors (``import_target``, shared with the reward loader in ``grpo.rewards.registry``), and the environment class
(``load_env_class``), checked against the protocol before any trajectory starts."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from llamafactory_qwenvl_patch.agent.types import PROTOCOL_METHODS

SPEC_FORMS = "module:Class or path/to/env.py:Class"


class UserCodeError(ValueError):
    """User code that cannot be loaded: the message names the spec, the file or module, and where it failed."""


class EnvLoadError(UserCodeError):
    """An environment class that cannot be used: not found, not a class, or without the protocol's methods."""


def _where(exc: BaseException) -> str:
    """The file and line an import failed at: the syntax error's own, else the innermost frame's."""
    if isinstance(exc, SyntaxError):
        return f"{exc.filename}, line {exc.lineno}"
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{frame.filename}, line {frame.lineno}"


def _missing_module(exc: BaseException, target: str) -> bool:
    """``target`` itself (or a package above it) does not exist, as opposed to a module it imports."""
    name = getattr(exc, "name", None)
    return isinstance(exc, ModuleNotFoundError) and bool(name) and (target == name or target.startswith(name + "."))


def import_target(target: str, what: str, prefix: str) -> ModuleType:
    """The module ``target`` names: a ``.py`` file (loaded as ``<prefix><stem>``) or an importable module.
    UserCodeError, prefixed with ``what`` (the spec as the user wrote it), when the file or module does not exist or
    its import raises (its exception and the file and line it raised at; ``sys.exit`` at import included)."""
    try:
        if target.lower().endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise UserCodeError(f"{what}: file {path} not found")
            module_name = f"{prefix}{path.stem}"  # the loader named: importlib picks one by suffix, and knows no .PY
            module_spec = importlib.util.spec_from_file_location(
                module_name, path, loader=importlib.machinery.SourceFileLoader(module_name, str(path)))
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
        return importlib.import_module(target)
    except UserCodeError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's module: a syntax error, a raise at import
        if _missing_module(exc, target):
            raise UserCodeError(f"{what}: module {target} not found ({type(exc).__name__}: {exc})") from None
        raise UserCodeError(f"{what}: {target} cannot be loaded: {type(exc).__name__}: {exc} "
                            f"({_where(exc)})") from None


def load_env_class(spec: str) -> type:
    """The environment class ``spec`` names (``module:Class`` or ``path/to/env.py:Class``), with an EnvLoadError
    naming what is wrong: the form, a missing file or module, an import that raised (file and line), a missing name,
    a name that is not a class, or a class without ``reset``, ``step`` or ``close``."""
    what = f"env {spec!r}"
    if not isinstance(spec, str) or spec.count(":") < 1 or not all(part.strip() for part in spec.rsplit(":", 1)):
        raise EnvLoadError(f"{what}: expected {SPEC_FORMS}")
    target, name = (part.strip() for part in spec.strip().rsplit(":", 1))
    try:
        module = import_target(target, what, "qwenvl_env_")
    except UserCodeError as exc:
        raise EnvLoadError(str(exc)) from None
    found: Any = getattr(module, name, None)
    if found is None:
        raise EnvLoadError(f"{what}: {target} has no class {name}")
    if not inspect.isclass(found):
        raise EnvLoadError(f"{what}: {name} is a {type(found).__name__}, not a class (one instance is made per "
                           "trajectory)")
    lacking = [method for method in PROTOCOL_METHODS if not callable(getattr(found, method, None))]
    if lacking:
        raise EnvLoadError(f"{what}: class {name} lacks {', '.join(lacking)}: an environment has reset(task, seed), "
                           "step(action) and close()")
    if getattr(found, "_is_protocol", False):
        raise EnvLoadError(f"{what}: {name} is a Protocol, the interface an environment follows, and cannot be "
                           "instantiated: name your class that implements it")
    if inspect.isabstract(found):
        raise EnvLoadError(f"{what}: class {name} is abstract (it does not implement "
                           f"{', '.join(sorted(found.__abstractmethods__))}) and cannot be instantiated")
    return found
