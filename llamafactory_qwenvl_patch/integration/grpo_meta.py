"""Carry each record's ``meta`` (written by ``qwenvl-prep convert`` as JSON text) through LLaMA-Factory's dataset
pipeline to the GRPO rewards, which receive it as ``metas`` (decoded by ``grpo.rollout.meta``).

LF drops every column it does not know, twice: ``align_dataset`` keeps only ``_prompt``, ``_response``, ... and the
PPO-stage processor only ``input_ids``, ``labels``, ``images``, ... So, while ``stage: grpo`` builds its datasets,
the converter also returns ``_meta`` and the processor keeps it as ``grpo_meta``, one row per row it keeps (it runs
LF's own processor one record at a time, so whatever LF drops, the meta is dropped with it). The aligned prompt
messages, system prompt and tools travel the same way as ``grpo_task``: an agent run renders its turns from them.
"""

from __future__ import annotations

import json
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

from llamafactory_qwenvl_patch.grpo.rollout.meta import META_COLUMN, TASK_COLUMN
from llamafactory_qwenvl_patch.integration import lf_compat

_state: dict[str, Any] = {}


class _MetaConverter:
    """LF's converter for one dataset, plus the record's ``meta`` as text ("" when it has none)."""

    def __init__(self, converter: Any) -> None:
        self.converter = converter

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        meta = example.get("meta")
        out = self.converter(example)
        task = {"prompt": out["_prompt"], "system": out["_system"] or None, "tools": out["_tools"] or None}
        return {**out, "_meta": "" if meta is None else meta if isinstance(meta, str) else json.dumps(meta),
                "_task": json.dumps(task, ensure_ascii=False)}


def _get_converter(name: str, dataset_attr: Any, data_args: Any) -> _MetaConverter:
    return _MetaConverter(_state["get_dataset_converter"](name, dataset_attr, data_args))


def _preprocess(self: Any, examples: dict[str, list[Any]]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = defaultdict(list)
    for i, meta in enumerate(examples["_meta"]):
        one = _state["preprocess_dataset"](self, {key: values[i:i + 1] for key, values in examples.items()})
        for key, values in one.items():
            out[key] += values
        out[META_COLUMN] += [meta] * len(one.get("input_ids", []))
        out[TASK_COLUMN] += [examples["_task"][i]] * len(one.get("input_ids", []))
    return out


@contextmanager
def carrying_meta() -> Iterator[None]:
    """While building the GRPO datasets, keep each record's ``meta`` as the column ``grpo_meta``."""
    converter = lf_compat.require_module("llamafactory.data.converter", ["get_dataset_converter", "align_dataset"])
    unsupervised = lf_compat.require_module("llamafactory.data.processor.unsupervised",
                                            ["UnsupervisedDatasetProcessor"])
    lf_compat.require(unsupervised.UnsupervisedDatasetProcessor, ["preprocess_dataset"])
    _state.update(get_dataset_converter=converter.get_dataset_converter,
                  preprocess_dataset=unsupervised.UnsupervisedDatasetProcessor.preprocess_dataset)
    converter.get_dataset_converter = _get_converter
    unsupervised.UnsupervisedDatasetProcessor.preprocess_dataset = _preprocess
    try:
        yield
    finally:
        converter.get_dataset_converter = _state["get_dataset_converter"]
        unsupervised.UnsupervisedDatasetProcessor.preprocess_dataset = _state["preprocess_dataset"]
