"""A processor built with only min/max_pixels keeps its bounds to itself (transformers writes them into the class's
``size`` dict otherwise, and every later processor in the process inherits them)."""

from __future__ import annotations

import importlib

from llamafactory_qwenvl_patch.image_io.processor_sizes import CLASSES, SHARED_DICT_LINE, keep_processor_class_sizes


def _classes() -> list[type]:
    found = []
    for module, name in CLASSES:
        try:
            found.append(getattr(importlib.import_module(f"transformers.models.{module}"), name))
        except (ImportError, AttributeError):
            continue
    return found


def test_bounds_given_to_one_processor_do_not_reach_the_next() -> None:
    guarded = keep_processor_class_sizes()
    assert keep_processor_class_sizes() == guarded  # idempotent
    classes = _classes()
    assert classes and {cls.__name__ for cls in classes} >= set(guarded)
    assert guarded, f"no class has {SHARED_DICT_LINE!r} any more: drop the guard"
    for cls in classes:
        if cls.__name__ not in guarded:
            continue
        default = dict(cls.size)
        pinned = cls(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
        assert (pinned.size["shortest_edge"], pinned.size["longest_edge"]) == (4 * 28 * 28, 16 * 28 * 28)
        assert dict(cls.size) == default, cls.__name__
        later = cls()
        assert (later.size["shortest_edge"], later.size["longest_edge"]) == (default["shortest_edge"],
                                                                            default["longest_edge"]), cls.__name__
