"""``qwenvl-prep convert``: grounding data in original-image coordinates -> LF sharegpt in the model's frame.

Streams the input, reads image headers only (and videos' packet times, never their pixels), converts in parallel
workers (``convert_record``) and writes atomically; bad records become rows of a JSONL error report. The output's
``dataset_info.json`` entry (``dataset_info``) carries the policy stamp, with the video policy when the output has
videos (and the frame lists' rate when they are frame lists: one kind per dataset, as LF reads them).
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Iterable, Iterator

from llamafactory_qwenvl_patch.frame.stamp import STAMP_KEY, Stamp, read_dataset_info, stamp_of
from qwenvl_prep import __version__
from qwenvl_prep.formats.benchmarks import (
    DEFAULT_TARGET, PROMPTS, ImageStore, check_prompt, iter_refcoco_parquet, iter_screenspot,
)
from qwenvl_prep.formats.coco import CocoOptions, CocoReader, find_image_dir
from qwenvl_prep.formats.prompt_presets import ANSWERS, BENCHMARK_FORMATS, PresetError, preset_for
from qwenvl_prep.formats.records import detect_format, iter_raw
from qwenvl_prep.formats.temporal import FORMATS as VIDEO_FORMATS, PROMPTS as VIDEO_PROMPTS, iter_temporal
from qwenvl_prep.formats.temporal import check_prompt as check_query_prompt
from qwenvl_prep.formats.temporal_datasets import FORMATS as DATASET_FORMATS, PROMPTS as DATASET_PROMPTS, iter_dataset
from qwenvl_prep.pipeline.convert_record import (
    ConvertError, Job, Result, Source, convert_chunk, init_convert_worker, set_job,
)
from qwenvl_prep.pipeline.convert_video import ROTATION_MODES
from qwenvl_prep.pipeline.dataset_info import SHAREGPT_ENTRY, check_dataset_name, merge_dataset_info
from qwenvl_prep.plumbing.atomic import atomic_writer
from qwenvl_prep.plumbing.outputs import check_output, require_regular_output
from qwenvl_prep.plumbing.workers import abandon_pool

INPUT_COORDS = {"abs": "orig", "rel1000": "rel1000", "rel1": "rel1"}
EXIF_MODES = ("error", "bake", "raw")
CHUNK = 1024


@dataclass
class ConvertOptions:
    input: Path
    output: Path
    target: Stamp
    input_coords: str | None = None
    fmt: str = "auto"
    image_dir: Path | None = None
    video_dir: Path | None = None  # relative video paths and a dataset's clips (default: image_dir)
    exif: str = "error"
    video_rotation: str = "error"  # clips whose display matrix turns them: error, bake or raw (convert_video.upright)
    workers: int = 1
    shard: tuple[int, int] = (0, 1)
    skip_bad: bool = False
    errors: Path | None = None
    dataset_name: str | None = None
    coco: CocoOptions = field(default_factory=CocoOptions)
    answer_target: str | None = None  # benchmark formats: the answer is the element's point or its box
    prompt: str | None = None  # benchmark formats: the prompt template, {instruction} ({query}) is replaced
    prompt_preset: str | None = None  # benchmark formats: a published prompt for the family (prompt and target)
    refcoco_expressions: str = "all"
    progress: bool = True
    overwrite: bool = False


def _input_stamp(path: Path) -> Stamp | None:
    """The stamp of the ``dataset_info.json`` entry that registers this very file, if any."""
    try:
        info = read_dataset_info(path.parent)
    except (OSError, ValueError):
        return None
    for entry in info.values():
        if isinstance(entry, dict) and entry.get("file_name") == path.name:
            return stamp_of(entry)
    return None


ORIGINAL_PIXEL_FORMATS = ("coco", *DEFAULT_TARGET)  # formats whose coordinates are original pixels by definition
QUERY_FORMATS = (*VIDEO_FORMATS, *DATASET_FORMATS)  # video formats whose prompt is a template with {query}


def _source(opts: ConvertOptions, fmt: str) -> Source:
    if fmt in ORIGINAL_PIXEL_FORMATS:
        if opts.input_coords not in (None, "abs"):
            raise ConvertError(f"{fmt} boxes are absolute pixels of the original image by definition; "
                               f"--input-coords {opts.input_coords} contradicts that (drop it or pass abs)")
        return Source("orig")
    stamp = _input_stamp(opts.input)
    if stamp is not None:
        if opts.input_coords is not None:
            raise ConvertError(
                f"{opts.input} is the output of qwenvl-prep convert ({stamp.describe()}); its coordinates are "
                "already in that frame, so drop --input-coords (converting it again re-targets it, never rescales twice)"
            )
        if stamp.frame_list_fps is not None and stamp.frame_list_fps != opts.target.frame_list_fps:
            raise ConvertError(f"{opts.input} holds frame lists read at {stamp.frame_list_fps:g} fps; converting them "
                               f"at {opts.target.frame_list_fps:g} fps would move every frame and label in time: pass "
                               f"--frame-list-fps {stamp.frame_list_fps:g}")
        model = stamp.coords == "model"
        return Source(stamp.coords, stamp.policy if model else None, stamp.video if model else None)
    if opts.input_coords is None:
        return Source(None)
    if opts.input_coords not in INPUT_COORDS:
        raise ConvertError(f"--input-coords must be one of {', '.join(INPUT_COORDS)}")
    return Source(INPUT_COORDS[opts.input_coords])


def _preset_prompt(opts: ConvertOptions, fmt: str) -> tuple[str, str]:
    """``--prompt-preset``: the (prompt template, answer target) of the benchmark's published prompt for the run's
    family; refused where convert's labels would answer it otherwise than the source does."""
    if opts.prompt is not None or opts.answer_target is not None:
        raise ConvertError("--prompt-preset sets the prompt and the answer target itself; give it without --prompt "
                           "and --target")
    try:
        preset = preset_for(opts.prompt_preset, opts.target.family)
    except PresetError as error:
        raise ConvertError(str(error)) from None
    if fmt not in BENCHMARK_FORMATS[preset.name]:
        raise ConvertError(f"--prompt-preset {preset.name} is for {' / '.join(BENCHMARK_FORMATS[preset.name])} input; "
                           f"{opts.input} is read as {fmt}")
    if preset.answer != "json":
        labels = "span" if preset.video else "bbox_2d / point_2d"
        raise ConvertError(f"the {preset.name} preset for {preset.family} is answered with {ANSWERS[preset.answer]}, "
                           f"but convert writes {labels} JSON labels: training on them would teach that prompt "
                           "another answer. Evaluate with it instead (qwenvl-prep predict --prompt-preset "
                           f"{preset.name}), or give --prompt")
    return preset.template, preset.target


def _image_store(opts: ConvertOptions) -> ImageStore:
    """Where the images of a parquet's rows go: ``<output stem>_images`` beside the output, a real folder."""
    folder = opts.output.parent / f"{opts.output.stem}_images"
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ConvertError(f"{folder} (where the parquet's images are written) is "
                           f"{'a symbolic link' if folder.is_symlink() else 'not a folder'}; qwenvl-prep does not "
                           "write through links it did not create: remove it or choose another -o")
    return ImageStore(folder)


def _stream(opts: ConvertOptions, fmt: str, coco: CocoReader | None, images: ImageStore | None, video_dir: Path
            ) -> Iterable:
    """The input's raw records, in file order."""
    if coco is not None:
        return coco
    if fmt in DEFAULT_TARGET:
        target = opts.answer_target or DEFAULT_TARGET[fmt]
        prompt = opts.prompt or PROMPTS[target]
        if images is not None:
            return iter_refcoco_parquet(opts.input, target, prompt, images, opts.refcoco_expressions)
        return iter_screenspot(opts.input, fmt, target, prompt)
    if fmt in VIDEO_FORMATS:
        return iter_temporal(opts.input, fmt, opts.prompt or VIDEO_PROMPTS[fmt])
    if fmt in DATASET_FORMATS:
        return iter_dataset(opts.input, fmt, video_dir, opts.prompt or DATASET_PROMPTS[fmt])
    return iter_raw(opts.input)


def _records(opts: ConvertOptions, stream: Iterable) -> Iterator[tuple[int, Any]]:
    shard, count = opts.shard
    for index, record in enumerate(stream):
        if index % count == shard:
            yield index, record


def _chunks(items: Iterator, size: int) -> Iterator[list]:
    while chunk := list(itertools.islice(items, size)):
        yield chunk


def _results(opts: ConvertOptions, job: Job, stream: Iterable) -> Iterator[Result]:
    """Converted records in input order: in this process when there are no workers or a single chunk (a pool could
    not share one out), else in a pool that is closed and joined once every result is in. ``Pool.terminate``, which
    ``with Pool`` calls on leaving, takes the task queue's read lock for good while idle workers may still wait for
    it (issue 33, class 11: a one-record convert hung there once in about 20 runs); errors and signals stop it with
    ``abandon_pool``, since terminate can also wait forever there."""
    chunks = _chunks(_records(opts, stream), CHUNK)
    head = list(itertools.islice(chunks, 2))
    if opts.workers <= 1 or len(head) < 2:
        set_job(job)
        for chunk in itertools.chain(head, chunks):
            yield from convert_chunk(chunk)
        return
    pool = _pool_context().Pool(opts.workers, initializer=init_convert_worker, initargs=(job, os.getpid()))
    try:
        for results in pool.imap(convert_chunk, itertools.chain(head, chunks)):
            yield from results
        pool.close()
        pool.join()
    except BaseException:  # an error, a signal, or the caller stopped reading
        abandon_pool(pool)
        raise


def _os_threads() -> int:
    """Threads of this process as the OS sees them (native ones included: torch, OpenMP, ...)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 2  # cannot tell: assume others exist


def _pool_context():
    """``fork`` when this process has one thread (fast: the CLI); ``forkserver`` when it has more (a test runner, a
    program that imported torch): a fork copies locks held by other threads, even native ones such as malloc's,
    into the worker, which may then wait forever."""
    return get_context("fork" if _os_threads() == 1 else "forkserver")


def run_convert(opts: ConvertOptions) -> dict[str, Any]:
    """Convert; returns the summary. Output and dataset_info are written only if nothing was dropped or skip_bad."""
    opts.input, opts.output = Path(opts.input), Path(opts.output)
    if not opts.input.is_file():
        raise ConvertError(f"input {opts.input} not found")
    if opts.output.resolve() == opts.input.resolve():
        raise ConvertError("output must differ from input: input files are never modified")
    if opts.output.suffix not in (".json", ".jsonl"):
        raise ConvertError(f"output {opts.output} must end in .json or .jsonl")
    _check_outputs(opts)
    if opts.exif not in EXIF_MODES:
        raise ConvertError(f"--exif must be one of {', '.join(EXIF_MODES)}")
    if opts.video_rotation not in ROTATION_MODES:
        raise ConvertError(f"--video-rotation must be one of {', '.join(ROTATION_MODES)}")
    fmt = detect_format(opts.input) if opts.fmt == "auto" else opts.fmt
    source = _source(opts, fmt)
    if opts.prompt_preset is not None:
        opts.prompt, opts.answer_target = _preset_prompt(opts, fmt)
    if opts.prompt is not None and (fmt in DEFAULT_TARGET or fmt in QUERY_FORMATS):
        try:
            (check_query_prompt if fmt in QUERY_FORMATS else check_prompt)(opts.prompt)
        except ValueError as error:
            raise ConvertError(str(error)) from None
    coco, image_dir = None, opts.image_dir or opts.input.parent
    if fmt == "coco":
        coco = CocoReader(opts.input, opts.coco)
        image_dir = opts.image_dir or find_image_dir(opts.input, coco.coco.file_names())
    video_dir = opts.video_dir or opts.image_dir or opts.input.parent
    if not video_dir.is_dir():
        raise ConvertError(f"the video folder {video_dir} (--video-dir) is not a folder")
    job = Job(opts.target, source, opts.exif, str(image_dir.resolve()), str(video_dir.resolve()),
              str(opts.output.parent.resolve()), str(opts.input),
              "canonical" if fmt in (*ORIGINAL_PIXEL_FORMATS, *QUERY_FORMATS) else fmt, opts.video_rotation,
              "video" if fmt in (*VIDEO_FORMATS, *DATASET_FORMATS) else "image")
    images = _image_store(opts) if fmt == "refcoco-parquet" else None
    stream = _stream(opts, fmt, coco, images, video_dir)
    errors_path = opts.errors or opts.output.with_name(opts.output.name + ".errors.jsonl")
    stats: Counter = Counter()
    extra: dict[str, Any] = {}
    stopped: Exception | None = None
    with ExitStack() as stack:  # the error report is streamed and committed even when the output is discarded
        if images is not None:  # no output written (refused, a signal, an error): the images this run added go too
            stack.callback(lambda: None if written else images.discard())
        written = False
        try:
            with atomic_writer(opts.output) as out:
                first = _write_records(opts, job, stream, out, stats, stack, errors_path)
                if coco is not None:
                    extra = {"coco": coco.summary(Path(job.image_root), "--image-dir" if opts.image_dir else "found")}
                if stats["dropped"] and not opts.skip_bad:
                    raise Abort(_summary(opts, stats, errors_path, written=False, extra=extra))
                if first:  # raised inside the writer: an existing output stays as it was
                    raise ConvertError(f"{opts.input} gave no records to write ({stats['records']} read, "
                                       f"{stats['dropped']} bad): nothing was written or registered")
            written = True
        except (Abort, ConvertError) as exc:
            stopped = exc
    if stopped is not None:
        raise stopped
    if not stats["dropped"] and errors_path.exists():
        errors_path.unlink()
    _register(opts, stats)
    return _summary(opts, stats, errors_path if stats["dropped"] else None, written=True, extra=extra)


def _write_records(opts: ConvertOptions, job: Job, stream: Iterable, out: Any, stats: Counter, stack: ExitStack,
                   errors_path: Path) -> bool:
    """Stream converted records to ``out`` and bad ones to the error report (opened at the first bad record), so
    memory stays flat however many records are bad. Returns True when nothing was written."""
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: the CLI stays single-threaded, so its workers can fork
    as_array = opts.output.suffix == ".json"
    out.write("[\n" if as_array else "")
    first, errors = True, None
    kinds: dict[str, tuple[str, int]] = {}  # the first record with videos: their kind, its index
    # closed as the stack unwinds: an error or a signal stops the pool now, not when (or whether) the suspended
    # generator is collected, which may be after the pool's own finalizer ran at exit (``_results``)
    results = stack.enter_context(closing(_results(opts, job, stream)))
    for result in tqdm(results, desc="convert", unit=" rec", disable=None if opts.progress else True):
        stats["records"] += 1
        if result.error is None and result.video_kind is not None:
            kind, first_index = kinds.setdefault("first", (result.video_kind, result.index))
            if kind != result.video_kind:
                result = Result(result.index, error={
                    "record": result.index, "file": job.source_file, "video": result.video,
                    "error": f"the record's videos are {_KIND_NAMES[result.video_kind]}, record {first_index}'s are "
                             f"{_KIND_NAMES[kind]}; LLaMA-Factory reads one kind per dataset: convert them into two "
                             "datasets"})
        for key in ("passthrough", "boxes", "points", "exif_baked", "tools"):
            stats[key] += getattr(result, key)
        if result.error is None:
            for key in ("videos", "spans", "spans_clamped", "timed_boxes", "videos_baked"):
                stats[key] += getattr(result, key)
            stats["frame_lists"] += result.videos if result.video_kind == "frames" else 0
        if result.error is not None:
            if errors is None:
                errors = stack.enter_context(atomic_writer(errors_path))
            errors.write(json.dumps(result.error, ensure_ascii=False) + "\n")
            stats["dropped"] += 1
            continue
        stats["written"] += 1
        out.write((("" if first else ",\n") + result.line) if as_array else result.line + "\n")
        first = False
    out.write("\n]\n" if as_array else "")
    return first


def _check_outputs(opts: ConvertOptions) -> None:
    """Refuse, before anything is written, outputs that would clobber an input, the registry, a file another
    registry entry uses, a link's target, or each other."""
    output, registry = opts.output.resolve(), (opts.output.parent / "dataset_info.json").resolve()
    errors = (opts.errors or opts.output.with_name(opts.output.name + ".errors.jsonl"))
    if output.is_dir():
        raise ConvertError(f"output {opts.output} is a directory")
    if output == registry or opts.output.name == "dataset_info.json":
        raise ConvertError(f"output {opts.output} would replace the dataset registry dataset_info.json")
    if errors.suffix != ".jsonl":
        raise ConvertError(f"--errors {errors} must end in .jsonl (it is a JSONL report; this also keeps it from "
                           "ever naming an image)")
    taken = {opts.input.resolve(): "the input", output: "the output (-o)", registry: "the registry dataset_info.json"}
    if errors.resolve() in taken:
        raise ConvertError(f"--errors {errors} is {taken[errors.resolve()]}; it would be overwritten")
    require_regular_output(registry, "the registry")
    if registry.exists() and (not os.access(registry, os.W_OK) or not registry.stat().st_mode & 0o222):
        raise ConvertError(f"{registry} is read-only; make it writable or convert into another folder")
    name = opts.dataset_name or opts.output.stem
    check_dataset_name(name)
    check_output(opts.output, "output", inputs=[opts.input], own_entry=name)
    check_output(errors, "--errors", inputs=[opts.input])
    entry = read_dataset_info(opts.output.parent).get(name)
    if entry is not None and not opts.overwrite:
        file_name = entry.get("file_name") if isinstance(entry, dict) else None
        raise ConvertError(f"{registry} already has a dataset named {name!r} (file {file_name!r}); pass "
                           "--overwrite to replace it, or add another with both another -o and --dataset-name")


class Abort(Exception):
    """Bad records and no --skip-bad: raised inside the atomic writer so that the partial output is discarded;
    carries the summary."""

    def __init__(self, summary: dict[str, Any]) -> None:
        super().__init__("records were dropped")
        self.summary = summary


_KIND_NAMES = {"file": "video files", "frames": "frame lists"}


def _register(opts: ConvertOptions, stats: Counter) -> None:
    """Merge this output's entry (with the stamp) into ``dataset_info.json``; other entries stay untouched. The
    ``tools`` and ``videos`` columns are mapped when a record carries tool definitions or videos (LF reads a column
    only when mapped)."""
    name = opts.dataset_name or opts.output.stem
    columns = {**SHAREGPT_ENTRY["columns"], **({"videos": "videos"} if stats["videos"] else {}),
               **({"tools": "tools"} if stats["tools"] else {})}
    entry = {"file_name": opts.output.name, **SHAREGPT_ENTRY, "columns": columns,
             STAMP_KEY: _written_stamp(opts, stats).to_dict()}
    merge_dataset_info(opts.output.parent, name, entry)


def _written_stamp(opts: ConvertOptions, stats: Counter) -> Stamp:
    """The output's stamp: the video policy only when it has videos, the frame-list rate only for frame lists."""
    video = opts.target.video if stats["videos"] else None
    fps = opts.target.frame_list_fps if stats["frame_lists"] else None
    return Stamp(opts.target.policy, opts.target.coords, opts.target.family, f"qwenvl-prep {__version__}", video,
                 fps)


def _summary(opts: ConvertOptions, stats: Counter, errors_path: Path | None, written: bool,
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "input": str(opts.input),
        "output": str(opts.output) if written else None,
        "dataset_name": (opts.dataset_name or opts.output.stem) if written else None,
        "records": stats["records"],
        "written": stats["written"] if written else 0,
        "dropped": stats["dropped"],
        "passthrough": stats["passthrough"],
        "boxes": stats["boxes"],
        "points": stats["points"],
        "exif_baked": stats["exif_baked"],
        **({key: stats[key] for key in ("videos", "frame_lists", "spans", "spans_clamped", "timed_boxes",
                                        "videos_baked")}
           if stats["videos"] else {}),
        "error_report": str(errors_path) if errors_path else None,
        "stamp": _written_stamp(opts, stats).to_dict(),
        **(extra or {}),
    }


def convert(opts: ConvertOptions) -> tuple[dict[str, Any], int]:
    """Run and map to an exit code: 0 when nothing was dropped (or --skip-bad), 1 otherwise."""
    try:
        summary = run_convert(opts)
    except Abort as abort:
        return abort.summary, 1
    return summary, 0
