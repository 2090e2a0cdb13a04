"""Predictions joined to a dataset by order, checked row by row, as ``eval`` and ``draw`` read them.

LF's ``generated_predictions.jsonl`` carries each record's label, ``qwenvl-prep predict`` output each record's
image: a row whose label or image differs from its record's, a row that is not an object, or files of different
lengths mean the predictions belong to other records, and nothing is scored or drawn against them.
"""

from __future__ import annotations

import warnings
from itertools import zip_longest
from pathlib import Path
from typing import Iterator

from llamafactory_qwenvl_patch.scoring.answers import too_many_items
from qwenvl_prep.formats.converted import DatasetRef, Sample, iter_jsonl, iter_samples


class AlignmentError(ValueError):
    """The predictions file does not line up with the dataset."""


def _norm(text: str) -> str:
    return " ".join(text.split())


def _prediction_text(row: dict, index: int, predictions: str | Path) -> str:
    for key in ("predict", "prediction"):
        if isinstance(row.get(key), str):
            return row[key]
    raise AlignmentError(f"predictions row {index} of {predictions} has no 'predict' text")


def aligned(ref: DatasetRef, predictions: str | Path) -> Iterator[tuple[int, Sample, str]]:
    """(index, dataset record, prediction text) in order; AlignmentError naming the row at the first mismatch. A
    record the dataset cannot be read for (``Sample.error``) is yielded unchecked: the caller decides. Answers longer
    than a model writes (``too_many_items``), which the scorers read as parse failures, are named in one warning at
    the end."""
    index, over = -1, []
    for index, (row, sample) in enumerate(zip_longest(iter_jsonl(predictions), iter_samples(ref))):
        if row is None or sample is None:
            raise AlignmentError(f"{predictions} and {ref.path} have different numbers of records (one ends at "
                                 f"{index}); predictions must be in dataset order, one per record")
        if not isinstance(row, dict):
            raise AlignmentError(f"{predictions} line {index + 1} is a {type(row).__name__}, not an object")
        if not sample.error:
            if "label" in row and _norm(str(row["label"])) != _norm(sample.answer):
                raise AlignmentError(f"predictions row {index} of {predictions}: its label {str(row['label'])[:80]!r} differs from "
                                     f"dataset record {index}'s answer {sample.answer[:80]!r}; the files are "
                                     "misaligned")
            if "image" in row and sample.images and \
                    Path(str(row["image"])).resolve() != Path(sample.images[0]).resolve():
                raise AlignmentError(f"predictions row {index} of {predictions} is for {row['image']}, dataset record {index} for "
                                     f"{sample.images[0]}; the files are misaligned")
        text = _prediction_text(row, index, predictions)
        if (why := too_many_items(text)) is not None:
            over.append((index, why))
        yield index, sample, text
    if over:
        rows = ", ".join(str(i) for i, _ in over[:5]) + (", ..." if len(over) > 5 else "")
        warnings.warn(f"{predictions}: {len(over)} answer(s) longer than a model writes, scored as parse failures "
                      f"(rows {rows}); row {over[0][0]}: {over[0][1]}", stacklevel=2)
