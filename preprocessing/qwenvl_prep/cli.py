"""``qwenvl-prep`` command line. Subcommands import their heavy modules lazily, so ``--help`` answers fast."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable, Sequence

# Pillow imports numpy, whose OpenBLAS starts a thread per core at import: the CLI would no longer be single-threaded
# and convert's pool would use forkserver instead of fork (slower to start, and a worker still starting when a run is
# stopped printed a FileNotFoundError traceback). qwenvl-prep's numpy work is elementwise: one BLAS thread loses
# nothing. Set before the imports below.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from llamafactory_qwenvl_patch.frame.families import DEFAULT, FAMILIES  # noqa: E402
from llamafactory_qwenvl_patch.model_files.readers import READERS  # noqa: E402
from qwenvl_prep.benchmark_formats import DEFAULT_TARGET, PROMPTS  # noqa: E402
from qwenvl_prep.coco import CROWD_MODES, DEFAULT_PROMPT as DEFAULT_COCO_PROMPT  # noqa: E402
from qwenvl_prep.predict import MIN_TEMPERATURE  # noqa: E402
from qwenvl_prep.tiny_model import SIZES as TINY_SIZES  # noqa: E402
from qwenvl_prep.workers import one_line_warnings  # noqa: E402

FORMATS = ["auto", "sharegpt", "alpaca", "jsonl", "coco", *DEFAULT_TARGET]


def _tiny_model(args: argparse.Namespace) -> int:
    from qwenvl_prep.tiny_model import build_tiny_model

    out = build_tiny_model(args.out, family=args.family, seed=args.seed, size=args.size, moe=args.moe)
    print(json.dumps({"model_dir": str(out), "family": args.family, "size": args.size, "moe": args.moe}))
    return 0


def _spec(args: argparse.Namespace):
    """The run's policy: from the LF training YAML, or from explicit flags."""
    from qwenvl_prep.run_spec import spec_from_flags, spec_from_yaml

    if args.from_yaml:
        spec = spec_from_yaml(args.from_yaml, family=args.family)
        if not spec.patched:
            print(f"warning: {args.from_yaml} does not set `qwenvl_patch: true`; stock LLaMA-Factory resizes "
                  "differently and will not train in this frame", file=sys.stderr)
        return spec
    if args.min_pixels is None or args.max_pixels is None:
        raise ValueError("give --from-yaml TRAIN.yaml, or both --min-pixels and --max-pixels")
    return spec_from_flags(args.min_pixels, args.max_pixels, args.family or DEFAULT)


def _shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes i/n, got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard i/n needs 0 <= i < n, got {text!r}")
    return index, count


def _absent(text: str) -> int:
    """``--coco-absent``: a count, or ``all`` (-1)."""
    if text == "all":
        return -1
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--coco-absent takes a count >= 0 or 'all', got {text!r}")
    return int(text)


def _finite(flag: str, zero_allowed: bool, note: str = "", least: float = 0.0) -> Callable[[str], float]:
    """An argparse type: a finite number > 0 (at least ``least`` when given), or also 0 with ``zero_allowed`` (nan
    and inf are mistakes, not values)."""
    bound = f">= {least:g}" if least else "> 0"
    bound = f"0 or {bound}" if zero_allowed and least else (">= 0" if zero_allowed else bound)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        positive = value >= least if least else value > 0
        if not (math.isfinite(value) and (positive or (zero_allowed and value == 0))):
            raise argparse.ArgumentTypeError(f"{flag} takes a number {bound}{note}, got {text!r}")
        return value

    return parse


def _seed(text: str) -> int:
    """An argparse type: a seed numpy and torch both accept (0 to 2**32 - 1), refused here rather than in a
    training subprocess's log."""
    value = _count(0)(text)
    if value >= 2**32:
        raise argparse.ArgumentTypeError(f"a seed must be below 2**32, got {value}")
    return value


def _count(least: int):
    """An argparse type: an integer >= ``least`` (a negative --workers or --sample is a mistake, not a default)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return parse


def _print_summary(summary: dict, code: int) -> int:
    print(json.dumps(summary, indent=2))
    return code


def _convert(args: argparse.Namespace) -> int:
    from qwenvl_prep.coco import CocoOptions
    from qwenvl_prep.convert import ConvertOptions, convert

    opts = ConvertOptions(
        input=args.input, output=args.output, target=_spec(args).stamp, input_coords=args.input_coords,
        fmt=args.format, image_dir=args.image_dir, exif=args.exif, workers=args.workers, shard=args.shard,
        skip_bad=args.skip_bad, errors=args.errors, dataset_name=args.dataset_name, answer_target=args.answer_target,
        prompt=args.prompt, refcoco_expressions=args.refcoco_expressions, progress=not args.quiet,
        overwrite=args.overwrite, coco=CocoOptions(prompt=args.coco_prompt, group=args.coco_group,
                                                   crowd=args.coco_crowd, absent=args.coco_absent),
    )
    summary, code = convert(opts)
    if summary["dropped"]:
        verb = "skipped" if code == 0 else "found; nothing was written"
        print(f"{summary['dropped']} bad record(s) {verb}: see {summary['error_report']}", file=sys.stderr)
    if "coco" in summary:
        print(_coco_note(summary["coco"]), file=sys.stderr)
    return _print_summary(summary, code)


def _coco_note(coco: dict) -> str:
    """One line on what a COCO file gave and what it left out, and why."""
    note = (f"COCO: {coco['images']} images, {coco['annotations']} annotations (images from {coco['image_dir']}) -> "
            f"{coco['samples_with_boxes']} samples with boxes, {coco['samples_not_present']} 'not present' samples")
    if coco["images_without_annotations"]:
        note += (f"; {coco['images_without_annotations']} images have no annotation"
                 + ("" if coco["samples_not_present"] else " and gave no sample (--coco-absent N asks about absent "
                    "categories)"))
    if coco["samples_dropped_for_crowd"]:
        note += (f"; {coco['samples_dropped_for_crowd']} samples with crowd regions not written (--coco-crowd "
                 "ignore|box keeps them)")
    return note


def _curriculum(args: argparse.Namespace) -> int:
    from qwenvl_prep.curriculum import CurriculumOptions, parse_stages, run_curriculum

    summary = run_curriculum(CurriculumOptions(
        input=args.input, base_yaml=args.from_yaml, stages=parse_stages(args.stages), out=args.out,
        eval_input=args.eval_input, input_coords=args.input_coords, fmt=args.format, image_dir=args.image_dir,
        exif=args.exif, workers=args.workers, dataset_name=args.dataset_name, overwrite=args.overwrite,
        progress=not args.quiet))
    return _print_summary(summary, 0)


def _check(args: argparse.Namespace) -> int:
    from qwenvl_prep.check import check_dataset, format_report
    from qwenvl_prep.dataset import resolve_dataset
    from qwenvl_prep.run_spec import load_yaml, spec_from_yaml

    spec = spec_from_yaml(args.yaml)
    names = args.datasets or list(spec.datasets)
    if not names:
        raise ValueError(f"{args.yaml} names no dataset; pass dataset names or files")
    model = load_yaml(args.yaml).get("model_name_or_path")
    reports = [check_dataset(resolve_dataset(name, spec.dataset_dir), spec, model, args.decode, args.workers)
               for name in names]
    if not spec.patched:
        print(f"warning: {args.yaml} does not set `qwenvl_patch: true`", file=sys.stderr)
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        print("\n".join(format_report(r) for r in reports))
    return 0 if all(r.ok for r in reports) else 1


def _stamped_dataset(args: argparse.Namespace):
    """The dataset and the frame of its coordinates: its stamp, or the policy flags for an unstamped file."""
    from qwenvl_prep.dataset import resolve_dataset

    ref = resolve_dataset(args.dataset, args.dataset_dir)
    if ref.stamp is not None:
        return ref, ref.stamp
    if not args.from_yaml and args.min_pixels is None:
        raise ValueError(f"{ref.path} is unstamped: give --from-yaml or --min-pixels/--max-pixels/--family")
    return ref, _spec(args).stamp


def _draw(args: argparse.Namespace) -> int:
    from qwenvl_prep.draw import draw

    ref, stamp = _stamped_dataset(args)
    result = draw(ref, stamp, args.out, args.frame, args.sample, args.seed, args.predictions)
    print(json.dumps(result, indent=2))
    return 0


def _fix_config(args: argparse.Namespace) -> int:
    from qwenvl_prep.fixconfig import inspect_model, repair_for, rewrite_flat

    bounds = None
    if args.yaml:
        stamp = _spec(argparse.Namespace(from_yaml=args.yaml, family=None)).stamp
        bounds = (stamp.policy.min_pixels, stamp.policy.max_pixels)
    if args.dry_run and not args.target:
        raise ValueError("--dry-run goes with --target READER")
    rewrite = None
    if args.flatten:
        rewrite = rewrite_flat(args.model_dir)
    elif args.target:
        rewrite = repair_for(args.model_dir, args.target, args.dry_run)
    report = inspect_model(args.model_dir, bounds)
    if rewrite is not None:
        report["rewrite"] = rewrite
    print(json.dumps(report, indent=2))
    needs_repair = args.dry_run and bool(rewrite and rewrite["would_change"])
    return 1 if report["problems"] or needs_repair else 0


def _predict(args: argparse.Namespace) -> int:
    from qwenvl_prep.atomic import atomic_writer
    from qwenvl_prep.dataset import resolve_dataset
    from qwenvl_prep.outputs import Outputs
    from qwenvl_prep.predict import Predictor

    if args.seed is not None and args.temperature == 0:
        raise ValueError("--seed only acts with --temperature > 0: greedy answers do not depend on a seed")
    registries = []
    if args.dataset:
        ref = resolve_dataset(str(args.dataset))
        from qwenvl_prep.dataset import iter_samples

        jobs = [(s.images[0], s.prompt.replace("<image>", "").strip(), s.answer) for s in iter_samples(ref)]
        registries = [ref.media_dir]
    elif args.images and args.prompt:
        jobs = [(image, args.prompt, None) for image in args.images]
    else:
        raise ValueError("give --dataset FILE, or images with --prompt")
    guard = Outputs([args.model_dir, *([args.dataset] if args.dataset else []), *(image for image, _, _ in jobs)],
                    registries)
    if args.output:
        guard.check(args.output, "-o")
    drawings = []
    if args.draw:
        from qwenvl_prep.draw import prediction_paths

        drawings = [guard.check(p, "--draw", inside=args.draw) for p in prediction_paths(len(jobs), args.draw)]
    predictor = Predictor(args.model_dir, args.max_new_tokens, args.temperature, args.seed or 0)
    from tqdm import tqdm

    rows = []
    with tqdm(total=len(jobs), desc="predict", unit=" img", disable=None) as bar:
        for first in range(0, len(jobs), args.batch_size):
            chunk = jobs[first:first + args.batch_size]
            for row, (_, _, label) in zip(predictor.batch([(image, prompt) for image, prompt, _ in chunk]), chunk):
                if label is not None:
                    row["label"] = label
                rows.append(row)
            bar.update(len(chunk))
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if args.output:
        with atomic_writer(args.output) as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    if args.draw:
        from qwenvl_prep.draw import draw_predictions

        draw_predictions(rows, drawings)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from qwenvl_prep.atomic import write_json
    from qwenvl_prep.evaluate import evaluate, format_table, plot
    from qwenvl_prep.outputs import guard_dataset_outputs

    ref, stamp = _stamped_dataset(args)
    guard_dataset_outputs(ref, [args.predictions], {"--json-out": args.json_out, "--plot": args.plot})
    result = evaluate(ref, stamp, args.predictions, by=[f.strip() for f in (args.by or "").split(",") if f.strip()])
    if args.json_out:
        write_json(args.json_out, result)
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from qwenvl_prep.demo import run_demo

    summary = run_demo(args.out, minutes=args.minutes, family=args.family, task=args.task, steps=args.steps,
                       seed=args.seed, controls=args.controls)
    print(json.dumps(summary, indent=2))
    if args.task == "grounding":
        from qwenvl_prep.demo import format_summary

        print(format_summary(summary), file=sys.stderr)
    elif args.task == "gui":
        from qwenvl_prep.demo_gui import format_gui_summary

        print(format_gui_summary(summary), file=sys.stderr)
    else:
        from qwenvl_prep.demo_fields import format_summary as format_fields_summary

        print(format_fields_summary(summary), file=sys.stderr)
    return 0


def _add_policy_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("resize policy (the run's frame)")
    group.add_argument("--from-yaml", metavar="TRAIN.yaml", help="read image_min_pixels, image_max_pixels, template "
                       "and the model family from the LLaMA-Factory training YAML (recommended)")
    group.add_argument("--min-pixels", type=int, help="pinned image_min_pixels (without --from-yaml)")
    group.add_argument("--max-pixels", type=int, help="pinned image_max_pixels (without --from-yaml)")
    group.add_argument("--family", choices=list(FAMILIES),
                       help="model family: Qwen2.5-VL trains on absolute model-frame pixels, Qwen2-VL, Qwen3-VL and "
                       "Qwen3.5 on relative 0-1000 (default: from the YAML's model config or template, else "
                       "qwen2_5_vl)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwenvl-prep",
        description="Convert, check, draw and evaluate Qwen-VL grounding datasets in exactly the frame the model "
        "sees, under the same resize policy as `llamafactory-cli train` with `qwenvl_patch: true`.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tiny = sub.add_parser(
        "tiny-model",
        help="build a tiny random-weight Qwen-VL checkpoint offline (CPU smoke tests)",
        description="Write a few-MB random-weight Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3.5 (real architecture, "
        "byte-level BPE tokenizer with the Qwen special tokens, processor, chat template) that LLaMA-Factory loads.",
    )
    tiny.add_argument("out", help="output folder (must not exist or be empty)")
    tiny.add_argument("--family", choices=[name for name, f in FAMILIES.items() if f.tiny], default=DEFAULT)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--moe", action="store_true", help="the mixture-of-experts variant (qwen3_5 only)")
    tiny.add_argument("--size", choices=list(TINY_SIZES), default="tiny",
                      help="tiny: fastest, for tests; small: ~1M parameters, enough to learn the demo's task")
    tiny.set_defaults(func=_tiny_model)

    conv = sub.add_parser(
        "convert",
        help="convert grounding data to LF sharegpt in the model's frame, stamped with the policy",
        description="Read LF sharegpt/alpaca JSON or JSONL, COCO instances, ScreenSpot / ScreenSpot-v2 / "
        "ScreenSpot-Pro annotation files, lmms-eval RefCOCO parquet, or plain {image, question, answer} JSONL; "
        "rewrite every bbox_2d / point_2d / <|box_start|> coordinate into the frame the model sees under the "
        "run's resize policy; write LF sharegpt and merge a stamped entry into dataset_info.json beside it.",
    )
    conv.add_argument("input", type=Path, help="input file (.json, .jsonl, or a COCO instances .json)")
    conv.add_argument("-o", "--output", type=Path, required=True, help="output .json or .jsonl (in the dataset_dir)")
    _add_policy_flags(conv)
    conv.add_argument("--input-coords", choices=["abs", "rel1000", "rel1"],
                      help="convention of the input coordinates: abs = original-image pixels (COCO is always abs). "
                      "Required when records have coordinates; never guessed")
    conv.add_argument("--format", choices=FORMATS, default="auto",
                      help="input format (default: auto, from the first record; .parquet is refcoco-parquet)")
    conv.add_argument("--image-dir", type=Path, help="base folder of relative image paths (default: the input's "
                      "folder; for COCO, the folder found as described below)")
    conv.add_argument("--exif", choices=["error", "bake", "raw"], default="error",
                      help="images with an EXIF rotation: error (default), bake = write an upright copy and read "
                      "coordinates on the displayed image, raw = coordinates are on the stored pixels")
    conv.add_argument("--workers", type=_count(1), default=os.cpu_count() or 1, help="parallel worker processes")
    conv.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N", help="convert records with index %% N == I")
    conv.add_argument("--skip-bad", action="store_true", help="drop bad records (listed in the error report), exit 0")
    conv.add_argument("--errors", type=Path, help="error report path (default: OUTPUT.errors.jsonl)")
    conv.add_argument("--dataset-name", help="dataset_info.json entry name (default: the output's stem)")
    conv.add_argument("--overwrite", action="store_true",
                      help="replace an existing dataset_info.json entry of the same name (refused otherwise)")
    coco = conv.add_argument_group(
        "COCO instances", "Images are looked up under --image-dir, else under the one folder near the JSON that holds "
        "them: the JSON's folder, the folder above it, its images/, its <split>/ and images/<split>/ (split from the "
        "file name: annotations/instances_val2017.json -> val2017/); two folders holding them is an error")
    coco.add_argument("--coco-prompt", default=DEFAULT_COCO_PROMPT,
                      help="prompt template, {category} is replaced (default: %(default)r)")
    coco.add_argument("--coco-group", choices=["category", "image"], default="category",
                      help="one conversation per (image, category) (default) or per image")
    coco.add_argument("--coco-crowd", choices=CROWD_MODES, default="drop",
                      help="iscrowd regions: drop (default) = a sample whose category has a crowd region in the image "
                      "is not written, since its answer cannot list every object; ignore = leave the crowd region "
                      "out of the answer; box = a crowd region is one more box")
    coco.add_argument("--coco-absent", type=_absent, default=0, metavar="N|all",
                      help="per image, N 'not present' samples (answer []) asking for categories the image has no "
                      "annotation of, chosen at random (seeded by the image id), or all of them (default 0: only "
                      "when your annotations are exhaustive do missing boxes mean absent objects)")
    conv.add_argument("--target", dest="answer_target", choices=["point", "box"],
                      help="ScreenSpot / RefCOCO: answer with the element's point_2d (its box centre) or its bbox_2d "
                      "(default: point for ScreenSpot, box for RefCOCO); the truth box goes to meta.bbox_orig either way")
    conv.add_argument("--prompt", help="ScreenSpot / RefCOCO prompt template, {instruction} is replaced (default: "
                      f"{PROMPTS['point']!r} for points, {PROMPTS['box']!r} for boxes)")
    conv.add_argument("--refcoco-expressions", choices=["all", "first"], default="all",
                      help="RefCOCO: one record per referring expression (default) or per row (its first)")
    conv.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=_convert)

    cur = sub.add_parser(
        "curriculum",
        help="a low-to-high resolution curriculum: one converted dataset and one training YAML per stage",
        description="Convert INPUT once per stage, each in the frame of that stage's image_max_pixels (stamped, so "
        "the qwenvl_patch guard accepts a stage's data only in that stage), and write OUT/stageK.yaml from the base "
        "YAML with that stage's bounds and dataset; each stage after the first resumes from the previous stage's "
        "output_dir (LoRA adapter, or full weights). Prints the stages and the command that runs them in order.",
    )
    cur.add_argument("input", type=Path, help="training data in original-image coordinates (any convert format)")
    cur.add_argument("--from-yaml", required=True, type=Path, metavar="BASE.yaml",
                     help="the training YAML every stage starts from (model, template, method, hyperparameters)")
    cur.add_argument("--stages", required=True, metavar="PIXELS,PIXELS,...",
                     help="image_max_pixels of each stage, low to high, e.g. 200704,1003520")
    cur.add_argument("-o", "--out", type=Path, required=True, help="folder for stageK.yaml and data/")
    cur.add_argument("--eval-input", type=Path, help="evaluation data, converted per stage like INPUT")
    cur.add_argument("--input-coords", choices=["abs", "rel1000", "rel1"],
                     help="convention of the input coordinates (required when records have coordinates)")
    cur.add_argument("--format", choices=FORMATS, default="auto")
    cur.add_argument("--image-dir", type=Path, help="base folder of relative image paths (default: the input's)")
    cur.add_argument("--exif", choices=["error", "bake", "raw"], default="error")
    cur.add_argument("--workers", type=_count(1), default=os.cpu_count() or 1)
    cur.add_argument("--dataset-name", help="dataset name prefix (default: the input's stem)")
    cur.add_argument("--overwrite", action="store_true", help="replace existing stage YAMLs")
    cur.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    cur.set_defaults(func=_curriculum)

    chk = sub.add_parser(
        "check",
        help="check datasets against a training YAML (stamp, images, boxes, tokens, drift audit)",
        description="Check that each dataset's stamp matches the YAML's bounds, factor and model family, that "
        "every image is readable, that boxes lie inside the frame, that image tokens fit cutoff_len, and audit how "
        "far stock LLaMA-Factory (without the plugin) would put the labels from what the model sees. Exit 1 on "
        "any problem.",
    )
    chk.add_argument("datasets", nargs="*", help="dataset_info names or files (default: the YAML's dataset list)")
    chk.add_argument("--yaml", required=True, metavar="TRAIN.yaml", help="the LLaMA-Factory training YAML")
    chk.add_argument("--decode", action="store_true", help="fully decode every image (parallel), not just headers")
    chk.add_argument("--workers", type=_count(1), default=os.cpu_count() or 1)
    chk.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    chk.set_defaults(func=_check)

    drw = sub.add_parser(
        "draw",
        help="draw ground truth (and predictions) on original or model-input images, plus a contact sheet",
        description="Draw boxes and points of a converted dataset with OpenCV: on the original image (coordinates "
        "mapped back) or on the exact image the model sees. Green: ground truth; red: predictions.",
    )
    drw.add_argument("dataset", help="dataset file or dataset_info name")
    drw.add_argument("-o", "--out", type=Path, required=True, help="output folder")
    drw.add_argument("--dataset-dir", default=".", help="folder of dataset_info.json when DATASET is a name")
    drw.add_argument("--frame", choices=["original", "model"], default="original")
    drw.add_argument("--sample", type=_count(0), default=16, help="number of records to draw, 0 = all (default: %(default)s)")
    drw.add_argument("--seed", type=int, default=0)
    drw.add_argument("--predictions", type=Path,
                     help="JSONL aligned with the dataset by order, with a 'predict' field (LF generated_predictions)")
    _add_policy_flags(drw)
    drw.set_defaults(func=_draw)

    fix = sub.add_parser(
        "fix-config",
        help="check a model folder against transformers 4.x/5.x and vLLM; repair it for one of them",
        description="Report the config layout, sub-config types, transformers version written vs installed, "
        "processor bounds vs a training YAML, and what each reader (transformers 4.49-4.51, 4.57, vLLM before 0.26, "
        "vLLM 0.26 and newer) cannot load or would load differently (`readers`: reader, file, key). --target READER "
        "rewrites the folder in the portable layout that transformers 4.49 to 5.x and every vLLM read in the training "
        "frame (what an export under `qwenvl_patch: true` writes), keeping each replaced file as NAME.bak-STAMP; it "
        "refuses, writing nothing, what it cannot repair. --flatten rewrites only config.json in the flat layout.",
    )
    fix.add_argument("model_dir", type=Path)
    fix.add_argument("--yaml", metavar="TRAIN.yaml", help="compare the processor bounds with this training YAML")
    mode = fix.add_mutually_exclusive_group()
    mode.add_argument("--target", choices=[*sorted(READERS), "vllm"], metavar="READER",
                      help=f"repair the folder so that this reader loads it in the training frame (backups kept): "
                      f"{', '.join(sorted(READERS))}, or vllm (the installed vLLM's; vllm-0.28 where none is)")
    mode.add_argument("--flatten", action="store_true", help="rewrite config.json in the flat layout (backup kept)")
    fix.add_argument("--dry-run", action="store_true",
                     help="with --target: list what would change, write nothing (exit 1 when something would)")
    fix.set_defaults(func=_fix_config)

    pred = sub.add_parser(
        "predict",
        help="generate with transformers and map boxes back to original pixels (JSON lines)",
        description="Resize each image with the model folder's pinned policy (the training frame), generate, parse "
        "bbox_2d / point_2d / <|box_start|> answers and map them back to original-image pixels.",
    )
    pred.add_argument("model_dir", type=Path,
                      help="exported model folder, a full checkpoint, or a LoRA adapter folder of llamafactory-cli "
                      "train (its local base is loaded and the adapter merged in memory; the adapter's frame wins)")
    pred.add_argument("images", nargs="*", help="image files (with --prompt)")
    pred.add_argument("--prompt", help="prompt for every image")
    pred.add_argument("--dataset", type=Path, help="converted dataset: its images and prompts, labels kept for eval")
    pred.add_argument("-o", "--output", type=Path, help="JSONL output (default: stdout)")
    pred.add_argument("--draw", type=Path, help="also draw predicted boxes on the original images into this folder")
    pred.add_argument("--max-new-tokens", type=_count(1), default=128)
    pred.add_argument("--batch-size", type=_count(1), default=8, help="images per generate call (left-padded)")
    pred.add_argument("--temperature", type=_finite("--temperature", True, " (0 = greedy)", least=MIN_TEMPERATURE),
                      default=0.0,
                      help="0 (default): greedy, the model's one best answer; > 0: sample at this temperature (no "
                      "top-k / top-p), e.g. 1.0 as GRPO's rollouts do, to measure how often the model gives an answer, "
                      "not only whether its best answer is one")
    pred.add_argument("--seed", type=_seed, help="seed of the sampling (only with --temperature > 0; default 0)")
    pred.set_defaults(func=_predict)

    ev = sub.add_parser(
        "eval",
        help="metrics in the original frame: Acc@0.5, mean IoU, click accuracy, detection F1 and mAP, by subset",
        description="Join predictions to a converted dataset by order (LF generated_predictions.jsonl: labels must "
        "match record by record; qwenvl-prep predict output: images must match) and score boxes in original "
        "pixels. Acc@0.5 counts a ground-truth box as found when its one-to-one matched prediction has IoU >= 0.5; "
        "records with a truth box in meta (ScreenSpot, RefCOCO) also get click accuracy (the answer's point, or its "
        "box's centre, inside the box); box records get precision / recall / F1 at IoU 0.5, COCO mAP@[.5:.95] "
        "(order-free, since answers carry no scores; pycocotools' own number beside it) and the detection-hack "
        "monitors.",
    )
    ev.add_argument("dataset", help="converted dataset file or dataset_info name")
    ev.add_argument("--predictions", type=Path, required=True)
    ev.add_argument("--dataset-dir", default=".", help="folder of dataset_info.json when DATASET is a name")
    ev.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ev.add_argument("--json-out", type=Path, help="also write the JSON result here")
    ev.add_argument("--plot", type=Path, help="bar chart by image size (PNG)")
    ev.add_argument("--by", metavar="FIELD,FIELD", help="also report each subset of records sharing these meta "
                    "values, e.g. --by platform,data_type (ScreenSpot) or --by group,ui_type (ScreenSpot-Pro)")
    _add_policy_flags(ev)
    ev.set_defaults(func=_eval)

    demo = sub.add_parser(
        "demo",
        help="the whole pipeline on 2 CPU cores in a few minutes (grounding about 4, gui 5, fields 7), ending with a "
        "model that learned the task",
        description="Synthesise a dataset (grounding: coloured rectangles on photos of mixed sizes; gui: screenshots "
        "at real screen sizes as a ScreenSpot file; fields: rendered invoices), build a small random-weight model, "
        "and run convert, check, llamafactory-cli train (SFT from scratch, then GRPO), export, predict, eval and "
        "draw into OUT. Held-out metrics of the trained model are printed next to the untrained model and a constant "
        "baseline measured in the same run; the JSON summary goes to stdout.",
    )
    demo.add_argument("out", type=Path, help="new output folder")
    demo.add_argument("--minutes", type=_finite("--minutes", False),
                      help="SFT training budget in minutes of 2 CPU cores, turned into a fixed step count (default 3 "
                      "for grounding, 3.33 (1,300 steps) for gui, 5 for fields: the model learns the task; less is a quicker smoke "
                      "run)")
    demo.add_argument("--steps", type=_count(1),
                      help="SFT steps, instead of --minutes (both curriculum stages together for fields)")
    demo.add_argument("--seed", type=_seed, default=0,
                      help="another seed draws another run (other images and initial weights; for fields also other "
                      "shuffles and samples), to see that learning is not one lucky draw (default %(default)s: the "
                      "numbers in docs/getting-started.md)")
    demo.add_argument("--controls", type=int,
                      help="gui: controls per screenshot, the instruction naming one (default 1: the model finds the "
                      "control; 2 or 3: it must also read which, and needs more steps: --minutes 8 for 2)")
    demo.add_argument("--family", choices=[name for name, f in FAMILIES.items() if f.tiny],
                      help=f"model family of the grounding and gui demos (default {DEFAULT} for grounding, qwen3_vl "
                      "for gui; Qwen2-VL, Qwen3-VL and Qwen3.5 answer in 0-1000)")
    demo.add_argument("--task", choices=["grounding", "gui", "fields"], default="grounding",
                      help="grounding (boxes, the default); gui: screenshots at real screen sizes written as a "
                      "ScreenSpot file, 'click <label>' answered with a point, GRPO with click,click_dense,format, "
                      "click accuracy by platform and element type; or fields: rendered invoices answered as JSON "
                      "objects, a two-stage resolution curriculum, GRPO with fields,format,no_cheat and the "
                      "blank-image control, field metrics")
    demo.set_defaults(func=_demo)
    return parser


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop) if main_thread else None  # unwind: temps removed, workers stopped
    shown = warnings.showwarning
    one_line_warnings(f"qwenvl-prep {args.command}")
    try:
        return func(args)
    except (OSError, ValueError, RuntimeError) as exc:  # OSError: a folder not writable, a disk full, ...
        print(f"qwenvl-prep {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qwenvl-prep {args.command}: interrupted; nothing partial was left behind", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
