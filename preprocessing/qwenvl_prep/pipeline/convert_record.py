"""One input record into the model frame, in a convert worker (or in the process for a single chunk): its images
resolved and measured from their headers (its videos probed, ``convert_video``), its coordinates checked in their
source frame and re-targeted, any failure an error row naming the record, the file and the image or video."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from llamafactory_qwenvl_patch.frame.policy import (
    PolicyError,
    ResizePolicy,
    check_box,
    check_point,
    keep_extent,
    retarget_coords,
)
from llamafactory_qwenvl_patch.frame.stamp import Stamp
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.image_io.images import ImageError
from llamafactory_qwenvl_patch.scoring.answers import AnswerError, Item, parse_answer
from qwenvl_prep.formats.records import RecordError, to_record
from qwenvl_prep.formats.temporal import ORIGIN_KEY
from qwenvl_prep.formats.temporal_datasets import CLAMP_KEY
from qwenvl_prep.lf.dataset_rules import images_of_turns, record_problem
from qwenvl_prep.pipeline import convert_video
from qwenvl_prep.plumbing.imageinfo import ImageInfo, bake_exif, read_info
from qwenvl_prep.plumbing.workers import init_worker


@dataclass(frozen=True)
class Source:
    """Coordinate convention of the input; ``policy`` (and ``video``, for its videos) is set when the input is a
    stamped model-frame dataset."""

    coords: str | None
    policy: ResizePolicy | None = None
    video: VideoPolicy | None = None


@dataclass(frozen=True)
class Job:
    """Everything a worker needs, shipped once per worker."""

    target: Stamp
    source: Source
    exif: str
    image_root: str
    video_root: str  # relative video paths (and a dataset's clips found by id) lie here
    out_dir: str
    source_file: str
    fmt: str
    video_rotation: str = "error"
    media: str = "image"  # the key an error row names its file under before the record's media are known


@dataclass(slots=True)
class Result:
    """One record's outcome; plain fields keep the pickling between worker and writer cheap."""

    index: int
    line: str | None = None
    error: dict | None = None
    passthrough: int = 0
    boxes: int = 0
    points: int = 0
    exif_baked: int = 0
    videos_baked: int = 0
    tools: int = 0
    videos: int = 0
    video_kind: str | None = None  # ``file`` or ``frames``: the writer keeps one kind per dataset, as LF reads
    media: str | None = None  # the record's first image or video, for an error row the writer adds
    video: str | None = None  # its first video, for an error row about its videos
    spans: int = 0
    spans_clamped: int = 0
    timed_boxes: int = 0


class ConvertError(ValueError):
    """A problem with the whole run (arguments, paths), as opposed to one record."""


_job: Job | None = None
_info_cache: dict[str, ImageInfo] = {}


def set_job(job: Job) -> None:
    """The run's job for ``convert_chunk`` in this process; the header and clip caches start empty."""
    global _job
    _job = job
    _info_cache.clear()
    convert_video.clear_cache()


def init_convert_worker(job: Job, parent_pid: int) -> None:
    """Pool workers leave interrupts to the parent, which stops them, and die with it (``workers.init_worker``: no
    traceback per worker on Ctrl-C, SIGTERM or a killed parent)."""
    init_worker("qwenvl-prep convert", parent_pid)
    set_job(job)


def _info(path: str) -> ImageInfo:
    info = _info_cache.get(path)
    if info is None:
        if len(_info_cache) > 8192:
            _info_cache.clear()
        info = _info_cache[path] = read_info(path)
    return info


def _resolve(path: str, root: str) -> str:
    """A local path for an image or video reference under ``root``; URLs and data URIs are refused by name (never a
    mangled path)."""
    if path.startswith("file://localhost/"):
        path = path[len("file://localhost"):]
    elif path.startswith("file://"):
        path = path[len("file://"):]
    scheme = path.split(":", 1)[0].lower() if ":" in path[:12] else ""
    if scheme in ("http", "https", "ftp", "s3", "gs", "data"):
        raise RecordError(f"image {path[:80]!r}: {scheme} URLs are not supported; download the images and use "
                          "local paths")
    if "\0" in path:
        raise RecordError(f"image path {path[:80]!r} contains a NUL byte")
    return os.path.normpath(os.path.join(root, path))


def _output_path(path: str, job: Job) -> str:
    """Relative to the output folder when the image lies under it (LF resolves against dataset_dir)."""
    prefix = str(job.out_dir) + os.sep
    return path[len(prefix):] if path.startswith(prefix) else path


def _transformer(job: Job, hw: tuple[int, int], video: bool = False):
    """Item -> target coordinates, checking each item in its source frame first: the image frame, or with ``video``
    the video frame of a clip of size ``hw``."""
    if video:
        target_hw, source_hw = convert_video.frame_sizes(job.target, job.source.video, job.source.policy is not None,
                                                         hw)
    else:
        target_hw = job.target.policy.model_size(*hw)
        source_hw = job.source.policy.model_size(*hw) if job.source.policy else target_hw
    src, dst = job.source.coords, job.target.coords

    def transform(item: Item) -> list[int]:
        box = item.kind == "bbox_2d"
        (check_box if box else check_point)(item.coords, src, hw, source_hw)
        out = retarget_coords(item.coords, src, source_hw, dst, target_hw, hw)
        return keep_extent(out, dst, hw, target_hw) if box else out

    return transform


def _check_declared_size(source: str, declared: list[int], image: str, info: ImageInfo, hw: tuple[int, int]
                         ) -> None:
    """An image's declared width/height (COCO's, a benchmark's ``img_size``) must be the size its boxes are on: the
    displayed image under ``--exif bake``, the stored pixels otherwise."""
    if (declared[1], declared[0]) == hw:
        return
    hint, seen = "a swapped or resized image folder?", ""
    if info.orientation != 1:
        seen = " as displayed" if hw == info.displayed_hw else " as stored"
        if (declared[1], declared[0]) == info.hw:
            hint = "that is the stored size: pass --exif raw if the boxes are on the stored pixels."
        elif (declared[1], declared[0]) == info.displayed_hw:
            hint = "that is the displayed size: pass --exif bake if the boxes are on the displayed image."
    raise RecordError(f"{source} declares image {image} as {declared[0]}x{declared[1]}, the file is {hw[1]}x{hw[0]}"
                      f"{seen}: {hint} Boxes would land in the wrong place")


def _labelled_size(job: Job, images: list[str], shown: int, info: ImageInfo, result: Result) -> tuple[int, int]:
    """(height, width) of the image the labels of image ``shown`` are on: its stored pixels, or under ``--exif
    bake`` the displayed ones (a rotated copy replaces it in ``images``); an EXIF-rotated image is refused under
    ``--exif error``."""
    if info.orientation == 1 or job.exif == "raw":
        return info.hw
    if job.exif == "error":
        raise RecordError(
            f"image {images[shown]} has EXIF orientation {info.orientation}: training sees the raw pixels, "
            "annotation tools usually show the rotated image. Pass --exif bake (write a rotated copy, "
            "coordinates are on the displayed image) or --exif raw (coordinates are on the raw pixels)"
        )
    images[shown] = str(bake_exif(images[shown], Path(job.out_dir, "exif_baked")))
    result.exif_baked += 1
    return info.displayed_hw


def convert_record(index: int, raw: Any, job: Job) -> Result:
    """Convert one raw input record; every failure becomes an error row naming record, file and the image or video
    (under that key) it was at."""
    result = Result(index)
    image = origin = None
    media_key = job.media
    try:
        record = to_record(raw, job.fmt)
        if isinstance(record, RecordError):
            raise record
        origin = record.get(ORIGIN_KEY)  # a video dataset's line or entry, for the error row
        if (problem := record_problem(record)) is not None:
            raise RecordError(problem)
        images = [_resolve(p, job.image_root) for p in record["images"]]
        videos = convert_video.resolve_videos(record.get("videos") or [], lambda p: _resolve(p, job.video_root))
        image = images[0] if images else (convert_video.name(videos[0]) if videos else None)
        media_key = "image" if images or not videos else "video"
        result.videos, result.media = len(videos), image
        result.video = convert_video.name(videos[0]) if videos else None
        result.video_kind = convert_video.kind(videos[0]) if videos else None
        turns = record["messages"]  # every turn: boxes in prompts, system prompts and tool results too
        parsed = [parse_answer(m["content"]) for m in turns]
        items = [item for p in parsed for item in p.items]
        infos = [_info(p) for p in images]
        clips = []
        for i, video in enumerate(videos):
            image, media_key = convert_video.name(video), "video"
            clip = convert_video.probe_clip(video, job.target)
            videos[i], upright = convert_video.upright(video, clip, job.video_rotation, job.out_dir, job.target)
            result.videos_baked += upright is not clip
            clips.append(upright)
        image, media_key = (result.video, "video") if clips else (result.media, "image")  # the clips' times next
        if clips and record.get(CLAMP_KEY) and len(clips) == 1:
            ends = []
            for turn in turns:
                if turn.get("role") == "assistant":
                    turn["content"], clamped = convert_video.clamp_span_ends(turn["content"], clips[0].duration)
                    ends += clamped
            if ends:
                result.spans_clamped = len(ends)
                record["meta"] = convert_video.with_meta(record.get("meta"), "span_ends_clamped_from", ends)
        if clips:
            result.spans, result.timed_boxes = convert_video.check_times([m["content"] for m in turns], clips,
                                                                         record.get("declared_duration"))
        if not items:
            result.passthrough = 1
            for path, info in zip(images, infos):
                image, media_key = path, "image"
                job.target.policy.model_size(*info.hw)
        elif clips:
            if job.source.coords is None:
                raise ConvertError("the record has coordinates: declare their convention with --input-coords")
            if len(clips) != 1 or images:
                raise RecordError(f"the record has coordinates, {len(images)} image(s) and {len(clips)} video(s); "
                                  "coordinates need exactly one image or one video")
            transform = _transformer(job, (clips[0].height, clips[0].width), video=True)
            for turn, answer in zip(turns, parsed):
                turn["content"] = answer.rewrite(transform)
            result.boxes = sum(item.kind == "bbox_2d" for item in items)
            result.points = sum(item.kind == "point_2d" for item in items)
        else:
            if job.source.coords is None:
                raise ConvertError("the record has coordinates: declare their convention with --input-coords")
            declared = record.get("coco_size") or record.get("declared_size")
            if declared and len(images) != 1:
                raise RecordError(f"the record declares an image size and has {len(images)} images; a declared "
                                  "size needs exactly 1")
            try:
                shown_in = images_of_turns([m["content"] for m in turns], [bool(p.items) for p in parsed],
                                           len(images))
            except ValueError as exc:
                raise RecordError(str(exc)) from None
            sizes: dict[int, tuple[int, int]] = {}
            for turn, answer, shown in zip(turns, parsed, shown_in):
                if not answer.items:
                    continue
                if shown not in sizes:
                    image, media_key = images[shown], "image"
                    sizes[shown] = _labelled_size(job, images, shown, infos[shown], result)
                    if declared:
                        _check_declared_size("COCO" if record.get("coco_size") else "the annotation", declared,
                                             image, infos[shown], sizes[shown])
                turn["content"] = answer.rewrite(_transformer(job, sizes[shown]))
            result.boxes = sum(item.kind == "bbox_2d" for item in items)
            result.points = sum(item.kind == "point_2d" for item in items)
        out = {"messages": record["messages"], "images": [_output_path(p, job) for p in images]}
        if videos:
            out["videos"] = [[_output_path(f, job) for f in v] if isinstance(v, list) else _output_path(v, job)
                             for v in videos]
        if len(clips) == 1:
            record["meta"] = convert_video.with_duration(record.get("meta"), clips[0])
        for key in ("tools", "meta"):
            if record.get(key) is not None:
                out[key] = record[key]
        result.tools = int("tools" in out)
        result.line = orjson.dumps(out).decode()
    except (RecordError, AnswerError, PolicyError, ImageError, ConvertError, KeyError, TypeError) as exc:
        message = str(exc) if not isinstance(exc, (KeyError, TypeError)) else f"malformed record ({exc!r})"
        message = f"{origin}: {message}" if isinstance(origin, str) else message
        result.error = {"record": index, "file": job.source_file, media_key: image, "error": message}
    return result


def convert_chunk(chunk: list[tuple[int, Any]]) -> list[Result]:
    """A chunk of (index, raw record) under the job ``set_job`` gave this process."""
    return [convert_record(index, record, _job) for index, record in chunk]
