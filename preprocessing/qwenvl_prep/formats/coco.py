"""COCO instances -> grounding conversations, and where a COCO file's images are.

One conversation per (image, category) or per image, boxes as ``bbox_2d`` JSON in original pixels (COCO's
[x, y, w, h] turned into corners). Every image, annotation or category that cannot be tied to a sample without
guessing (shared or malformed ids, unknown image or category ids, malformed boxes) becomes an error row naming it;
what is left out on purpose (crowd regions, images without annotations) is counted in ``stats``.
"""

from __future__ import annotations

import json
import os
import random
import string
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from qwenvl_prep.formats.records import RecordError
from qwenvl_prep.lf.dataset_rules import special_token_problem

DEFAULT_PROMPT = "Locate every {category} in the image and output the bbox_2d coordinates in JSON format."
NOT_PRESENT = "[]"  # the answer of a "not present" sample: no box
CROWD_MODES = ("drop", "ignore", "box")
PROBE = 64  # images whose files decide where the image folder is


@dataclass(frozen=True)
class CocoOptions:
    """``group``: one sample per (image, category) or per image. ``crowd``: drop = an (image, category) sample with a
    crowd region is not written (its answer could not list every object); ignore = crowd regions are left out of the
    answer (COCO detector practice); box = a crowd region is a box like any other. ``absent``: per image, this many
    "not present" samples (answer ``[]``) for categories the image has no annotation of; -1 = every such category."""

    prompt: str = DEFAULT_PROMPT
    group: str = "category"
    crowd: str = "drop"
    absent: int = 0


def check_options(options: CocoOptions) -> None:
    """Refuse options that cannot work, before anything is read (one line each)."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(options.prompt) if name is not None]
    except ValueError as exc:
        raise RecordError(f"--coco-prompt {options.prompt!r}: {exc} (write {{{{ and }}}} for literal braces)") from None
    if any(name != "category" for name in fields):
        raise RecordError(f"--coco-prompt {options.prompt!r}: the only placeholder is {{category}} (write {{{{ and "
                          "}} for literal braces)")
    if "<image>" in options.prompt:
        raise RecordError("--coco-prompt must not contain <image>: convert puts the one image tag in front of it")
    if (problem := special_token_problem(options.prompt)) is not None:
        raise RecordError(f"--coco-prompt {options.prompt!r} holds {problem}")
    if options.crowd not in CROWD_MODES:
        raise RecordError(f"--coco-crowd must be one of {', '.join(CROWD_MODES)}")
    if options.absent < -1:
        raise RecordError(f"--coco-absent takes a count >= 0 or 'all', got {options.absent}")
    if options.absent and options.group != "category":
        raise RecordError("--coco-absent needs --coco-group category: a 'not present' sample asks for one category")


def _show(value: Any) -> str:
    """A value from the file for a message, bounded (ids and names may be hostile)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_id(value: Any) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def _box_ok(bbox: Any) -> bool:
    return isinstance(bbox, list) and len(bbox) == 4 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in bbox)


def _size_problem(image: dict) -> str | None:
    """Why an image's declared ``width`` / ``height`` cannot be used (None: positive integers, or not declared)."""
    for key in ("width", "height"):
        if key not in image:
            continue
        value = image[key]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return f"its {key} is {_show(value)}, not a positive integer (leave the key out if it is unknown)"
    return None


def _ids(anns: list[tuple[int, dict]]) -> str:
    shown = [str(ann.get("id", f"#{n}"))[:40] for n, ann in anns[:5]]
    return ", ".join(shown) + (f" and {len(anns) - 5} more" if len(anns) > 5 else "")


class CocoFile:
    """A COCO instances file read once: its images, annotations and categories checked and indexed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, encoding="utf-8-sig") as f:
                coco = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise RecordError(f"{path} is not a valid COCO JSON file ({exc})") from None
        if not isinstance(coco, dict) or not isinstance(coco.get("images", []), list) \
                or not isinstance(coco.get("annotations", []), list) \
                or not isinstance(coco.get("categories", []), list):
            raise RecordError(f"{path}: a COCO file is a JSON object with 'images', 'annotations' and 'categories' "
                              "lists")
        self.images: list = coco.get("images") or []
        self.annotations: list = coco.get("annotations") or []
        self.categories, self.bad_categories = self._categories(coco.get("categories") or [])

    @staticmethod
    def _categories(entries: list) -> tuple[dict[Any, str], dict[Any, str]]:
        """id -> name, and id -> why it cannot be used (malformed, or declared twice with other names)."""
        names: dict[Any, str] = {}
        bad: dict[Any, str] = {}
        for entry in entries:
            cid = entry.get("id") if isinstance(entry, dict) else None
            if not _is_id(cid):
                continue  # cannot be referred to; an annotation using such an id is reported as unknown
            name = entry.get("name")
            if not isinstance(name, str) or not name.strip():
                bad[cid] = f"category {_show(cid)} has no name"
            elif "<image>" in name or "<video>" in name:
                bad[cid] = f"category {_show(cid)} is named {_show(name)}, which LLaMA-Factory reads as a media tag"
            elif (problem := special_token_problem(name)) is not None:
                bad[cid] = f"category {_show(cid)} is named {_show(name)}, which holds {problem}"
            elif cid in names and names[cid] != name:
                bad[cid] = f"category id {_show(cid)} is declared twice ({_show(names[cid])} and {_show(name)})"
            else:
                names[cid] = name
        for cid in bad:
            names.pop(cid, None)
        return names, bad

    def file_names(self) -> list[str]:
        return [image["file_name"] for image in self.images
                if isinstance(image, dict) and isinstance(image.get("file_name"), str)]


def image_dir_candidates(path: Path) -> list[Path]:
    """Where a COCO file's relative ``file_name``s may start, in order: the JSON's folder, the folder above it, its
    ``images/``, and the split's folder named like the file (``annotations/instances_val2017.json`` ->
    ``val2017/``, ``images/val2017/``), then ``images/`` beside the JSON. Only folders that exist."""
    folder = path.resolve().parent
    root = folder.parent
    splits = list(dict.fromkeys([path.stem.rsplit("_", 1)[-1], path.stem]))
    candidates = [folder, root, root / "images", *(root / s for s in splits), *(root / "images" / s for s in splits),
                  folder / "images"]
    return [c for c in dict.fromkeys(candidates) if c.is_dir()]


def find_image_dir(path: Path, file_names: list[str]) -> Path:
    """The one candidate folder under which the COCO file's images are (probing up to ``PROBE`` of them, spread over
    the file). Refuses, naming ``--image-dir``, when none holds them or when two hold different files for them."""
    if not file_names:
        return path.resolve().parent
    step = max(1, len(file_names) // PROBE)
    probe = file_names[::step][:PROBE]
    candidates = image_dir_candidates(path)
    found = {c: [os.path.realpath(os.path.join(c, name)) for name in probe if os.path.isfile(os.path.join(c, name))]
             for c in candidates}
    best = max((len(files) for files in found.values()), default=0)
    if best == 0:
        tried = ", ".join(str(c) for c in candidates) or str(path.resolve().parent)
        raise RecordError(f"{path}: cannot find its images (e.g. {probe[0]!r}) under {tried}; pass --image-dir "
                          "FOLDER, the folder its file_name entries are relative to")
    winners = [c for c, files in found.items() if len(files) == best]
    if any(found[c] != found[winners[0]] for c in winners[1:]):
        raise RecordError(f"{path}: its images (e.g. {probe[0]!r}) are under both {winners[0]} and {winners[1]}; "
                          "pass --image-dir FOLDER to say which")
    return winners[0]


@dataclass
class _Index:
    """Annotations by image id; image id -> why that image cannot be converted; annotations whose image_id no image
    has (by that id); messages for annotations without a usable image_id."""

    by_image: dict[Any, list[dict]] = field(default_factory=dict)
    broken: dict[Any, str] = field(default_factory=dict)
    orphans: dict[Any, list[tuple[int, dict]]] = field(default_factory=dict)
    malformed: list[str] = field(default_factory=list)


class CocoReader:
    """Samples from a COCO file: canonical records, or RecordErrors naming what is wrong; ``stats`` counts what was
    read and what was left out on purpose, filled as the samples are read."""

    def __init__(self, path: Path, options: CocoOptions) -> None:
        check_options(options)  # before a large file is read
        self.coco, self.options = CocoFile(path), options
        self.stats: Counter = Counter()

    def __iter__(self) -> Iterator[dict | RecordError]:
        coco, stats = self.coco, self.stats
        stats["images"], stats["annotations"] = len(coco.images), len(coco.annotations)
        images: dict[Any, list[int]] = {}
        for n, image in enumerate(coco.images):
            if isinstance(image, dict) and _is_id(image.get("id")):
                images.setdefault(image["id"], []).append(n)
        index = self._index(images)
        for n, image in enumerate(coco.images):
            if not isinstance(image, dict) or not _is_id(image.get("id")) or not isinstance(image.get("file_name"),
                                                                                                str):
                got = (image.get("id"), image.get("file_name")) if isinstance(image, dict) else (image, None)
                yield RecordError(f"COCO image #{n} has no 'id' or string 'file_name' (an id is an integer or a "
                                  f"string; got id {_show(got[0])}, file_name {_show(got[1])})")
                continue
            name, image_id = image["file_name"], image["id"]
            if len(images[image_id]) > 1:
                others = ", ".join(f"#{k}" for k in images[image_id] if k != n)
                yield RecordError(f"COCO image #{n} ({name}) shares id {_show(image_id)} with image(s) {others}: "
                                  "their annotations cannot be told apart")
            elif image_id in index.broken:
                yield RecordError(f"COCO image {name} (id {_show(image_id)}): {index.broken[image_id]}")
            elif (problem := _size_problem(image)) is not None:
                yield RecordError(f"COCO image {name} (id {_show(image_id)}): {problem}")
            else:
                yield from self._samples(image, index.by_image.get(image_id, []))
        yield from (RecordError(message) for message in index.malformed)
        for image_id, anns in index.orphans.items():
            yield RecordError(f"COCO annotation(s) {_ids(anns)} refer to image_id {_show(image_id)}, which no image "
                              "has: their boxes belong to no image")

    def _index(self, images: dict[Any, list[int]]) -> _Index:
        index = _Index()
        categories, bad_categories = self.coco.categories, self.coco.bad_categories
        for n, ann in enumerate(self.coco.annotations):
            image_id = ann.get("image_id") if isinstance(ann, dict) else None
            if not _is_id(image_id):
                ann_id = ann.get("id") if isinstance(ann, dict) else None
                index.malformed.append(f"COCO annotation #{n} (id {_show(ann_id)}) needs an integer or string "
                                       f"'image_id', got {_show(image_id)}")
                continue
            if image_id not in images:
                index.orphans.setdefault(image_id, []).append((n, ann))
                continue
            ann_id, category = _show(ann.get("id", f"#{n}")), ann.get("category_id")
            if not _is_id(category) or category not in categories:
                why = bad_categories.get(category, "which 'categories' does not declare") if _is_id(category) \
                    else "which is not an integer or string"
                index.broken.setdefault(image_id, f"annotation {ann_id} has category_id {_show(category)}, {why}")
            elif not _box_ok(ann.get("bbox")):
                index.broken.setdefault(image_id, f"annotation {ann_id} has bbox {_show(ann.get('bbox'))}, not "
                                                  "[x, y, w, h]")
            elif not (isinstance(ann.get("iscrowd", 0), int) and ann.get("iscrowd", 0) in (0, 1)):  # bools too
                index.broken.setdefault(image_id, f"annotation {ann_id} has iscrowd {_show(ann.get('iscrowd'))}, "
                                                  "not 0 or 1")
            else:
                index.by_image.setdefault(image_id, []).append(ann)
        as_text = {str(known): known for known in images}
        kind = {str: "string", int: "number"}
        for image_id in list(index.orphans):
            known = as_text.get(str(image_id), image_id)
            if known != image_id:  # "1" for 1 (or 1 for "1"): the boxes belong there, under the wrong type
                anns = index.orphans.pop(image_id)
                index.broken.setdefault(known, f"annotation(s) {_ids(anns)} refer to it as image_id "
                                               f"{_show(image_id)}, a {kind[type(image_id)]} where its id is a "
                                               f"{kind[type(known)]}; fix the type so that no box is lost")
        return index

    def _samples(self, image: dict, anns: list[dict]) -> Iterator[dict]:
        options, stats = self.options, self.stats
        names = self.coco.categories
        if not anns:
            stats["images_without_annotations"] += 1
        present = {ann["category_id"] for ann in anns}
        stats["crowd_annotations"] += sum(1 for ann in anns if ann.get("iscrowd"))
        groups: dict[Any, list[dict]] = {}
        for ann in anns:
            groups.setdefault(ann["category_id"] if options.group == "category" else None, []).append(ann)
        for members in groups.values():
            if any(ann.get("iscrowd") for ann in members):
                if options.crowd == "drop":
                    stats["samples_dropped_for_crowd"] += 1
                    continue
                if options.crowd == "ignore":
                    members = [ann for ann in members if not ann.get("iscrowd")]
                    if not members:
                        continue
            labels = [names[ann["category_id"]] for ann in members]
            items = [{"bbox_2d": [x, y, x + w, y + h], "label": label}
                     for (x, y, w, h), label in zip((ann["bbox"] for ann in members), labels)]
            stats["samples_with_boxes"] += 1
            yield self._record(image, ", ".join(dict.fromkeys(sorted(labels))),
                               json.dumps(items, ensure_ascii=False))
        if options.absent:
            absent = sorted((cid for cid in names if cid not in present), key=str)
            if options.absent > 0 and len(absent) > options.absent:
                absent = random.Random(repr(image["id"])).sample(absent, options.absent)
            for cid in absent:
                stats["samples_not_present"] += 1
                yield self._record(image, names[cid], NOT_PRESENT)

    def _record(self, image: dict, category: str, answer: str) -> dict:
        record = {"messages": [{"role": "user", "content": "<image>" + self.options.prompt.format(category=category)},
                               {"role": "assistant", "content": answer}],
                  "images": [image["file_name"]]}
        size = [image.get("width"), image.get("height")]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in size):
            record["coco_size"] = size
        return record

    def summary(self, image_dir: Path, found_by: str) -> dict[str, Any]:
        """The COCO part of convert's summary: what was read, where the images are, what was left out and why."""
        stats = self.stats
        return {"images": stats["images"], "annotations": stats["annotations"], "image_dir": str(image_dir),
                "image_dir_from": found_by, "samples_with_boxes": stats["samples_with_boxes"],
                "samples_not_present": stats["samples_not_present"],
                "images_without_annotations": stats["images_without_annotations"],
                "crowd_annotations": stats["crowd_annotations"], "crowd_mode": self.options.crowd,
                "samples_dropped_for_crowd": stats["samples_dropped_for_crowd"]}
