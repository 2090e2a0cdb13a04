"""``qwenvl-prep predict``: answers of a model folder in its pinned frame, mapped back to original pixels."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from qwenvl_prep.commands.options import count, finite, seed
from qwenvl_prep.formats.prompt_presets import PRESET_NAMES, PromptPreset
from qwenvl_prep.lf.dataset_rules import special_token_problem
from qwenvl_prep.pipeline.predict import MIN_TEMPERATURE, Ask
from qwenvl_prep.plumbing.resumable import ResumableOutput


Job = tuple[Any, "str | Ask", Any]  # (image, clip or frame list; the prompt; the label, None without a dataset)


def run(args: argparse.Namespace) -> int:
    """Answer every image (in batches), write JSON lines atomically, draw them when asked."""
    from qwenvl_prep.plumbing.outputs import Outputs
    if args.seed is not None and args.temperature == 0:
        raise ValueError("--seed only acts with --temperature > 0: greedy answers do not depend on a seed")
    if args.prompt_preset and not args.dataset:
        raise ValueError("--prompt-preset asks each record's instruction in the benchmark's words: give --dataset (a "
                         "ScreenSpot or RefCOCO file converted by qwenvl-prep convert)")
    if args.prompt_preset and args.prompt:
        raise ValueError("--prompt-preset is the prompt; give it without --prompt")
    if args.prompt and (problem := special_token_problem(args.prompt)) is not None:
        raise ValueError(f"--prompt holds {problem}")
    registries, frame_list_fps, preset = [], None, None
    if args.dataset:
        jobs, preset, ref = dataset_jobs(args)
        registries = [ref.media_dir]
        frame_list_fps = ref.stamp.frame_list_fps if ref.stamp is not None else None  # the rate it was converted at
    elif args.images and args.prompt:
        jobs = [(image, args.prompt, None) for image in args.images]
        warn_stored_turned([source for source, _, _ in jobs])
    else:
        raise ValueError("give --dataset FILE, or images (or videos) with --prompt")
    guard = Outputs([args.model_dir, *([args.dataset] if args.dataset else []),
                     *(path for source, _, _ in jobs for path in (source if isinstance(source, list) else [source]))],
                    registries)
    output = ResumableOutput(args.output, recorded_settings(args, jobs, preset), args.batch_size) \
        if args.output else None
    for path in output.outputs() if output else []:
        guard.check(path, "-o")
    drawings = []
    if args.draw and any(is_video(source) for source, _, _ in jobs):
        raise ValueError("--draw draws on images; for clips, run qwenvl-prep draw DATA --predictions OUTPUT, which "
                         "draws each clip's answer on its contact sheet")
    if args.draw:
        from qwenvl_prep.pipeline.draw import prediction_paths

        drawings = [guard.check(p, "--draw", inside=args.draw) for p in prediction_paths(len(jobs), args.draw)]
    if args.dataset:
        from qwenvl_prep.pipeline.predict import dataset_frame_problem

        problem = dataset_frame_problem(args.model_dir, ref.stamp)
        if problem:
            raise ValueError(f"{args.dataset} cannot score this model's answers: {problem}, and eval reads every "
                             "answer in the dataset's own frame. Convert the benchmark again for this model "
                             "(qwenvl-prep convert --from-yaml with its training YAML, or --family and the bounds of "
                             "its qwenvl_policy.json)")
    predictor = predictor_for(args, preset)  # loaded before any output is made: a refused folder leaves none
    if output is None:
        rows = answer_all(predictor, jobs, args.batch_size, frame_list_fps)
        sys.stdout.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    else:
        with output:  # a stopped run continues from its last whole batch
            if output.done < len(jobs):
                answer_all(predictor, jobs, args.batch_size, frame_list_fps, output)
            rows = output.rows()
    if args.draw:
        from qwenvl_prep.pipeline.draw import draw_predictions

        draw_predictions(rows, drawings)
    return 0


def dataset_jobs(args: argparse.Namespace) -> tuple[list[Job], PromptPreset | None, Any]:
    """The jobs of a converted dataset (its own prompts, or each record's instruction in the words of
    ``--prompt-preset``), the preset, and the dataset; ValueError naming the first record that cannot be asked."""
    from qwenvl_prep.formats.benchmarks import FORMAT_KEY
    from qwenvl_prep.formats.converted import iter_samples, resolve_dataset
    from qwenvl_prep.formats.prompt_presets import BENCHMARK_FORMATS, preset_for
    from qwenvl_prep.pipeline.predict import folder_family

    ref = resolve_dataset(str(args.dataset))
    preset = preset_for(args.prompt_preset, folder_family(args.model_dir)) if args.prompt_preset else None
    jobs = []
    for sample in iter_samples(ref):
        if sample.error:
            raise ValueError(f"record {sample.index} of {ref.path} cannot be asked: {sample.error}")
        if not sample.images and not sample.videos:
            raise ValueError(f"record {sample.index} of {ref.path} has no image or video: predict answers media")
        source, tag = (sample.videos[0], "<video>") if sample.videos and not sample.images else \
            (sample.images[0], "<image>")
        prompt = sample.prompt.replace(tag, "").strip()
        if preset is not None:
            meta = sample.meta if isinstance(sample.meta, dict) else {}
            instruction, formats = meta.get(preset.meta_key), BENCHMARK_FORMATS[preset.name]
            if meta.get(FORMAT_KEY) not in formats or not isinstance(instruction, str) or \
                    is_video(source) != preset.video:
                raise ValueError(
                    f"record {sample.index} of {ref.path} is not a {' / '.join(formats)} record converted by "
                    f"qwenvl-prep convert ({meta.get(FORMAT_KEY) or 'no meta.source_format'}; meta.{preset.meta_key} "
                    f"{'recorded' if isinstance(instruction, str) else 'missing'}): the {preset.name} preset asks "
                    "each record's own instruction, which convert keeps in meta since presets came; convert the "
                    "benchmark file again")
            if (problem := special_token_problem(instruction)) is not None:
                raise ValueError(f"record {sample.index} of {ref.path}: its meta.instruction holds {problem}")
            prompt = preset.user_text(instruction)  # in the preset's words, under its system prompt
        elif sample.system:  # an empty one trains under the template's default, as none does (LF's template)
            prompt = Ask(prompt, sample.system)  # asked under the system prompt the record trains with
        jobs.append((source, prompt, sample.answer))
    return jobs, preset, ref


def predictor_for(args: argparse.Namespace, preset: PromptPreset | None = None) -> Any:
    """The backend's predictor: transformers (default) or offline vLLM, asking in ``preset``'s words if given."""
    if args.backend == "vllm":
        from qwenvl_prep.pipeline.predict_vllm import VLLMPredictor

        return VLLMPredictor(args.model_dir, args.max_new_tokens, args.temperature, args.seed or 0,
                             args.tensor_parallel_size, preset)
    from qwenvl_prep.pipeline.predict import Predictor

    return Predictor(args.model_dir, args.max_new_tokens, args.temperature, args.seed or 0, preset)


def answer_all(predictor: Any, jobs: list[Job], batch_size: int, frame_list_fps: float | None,
               output: Any = None) -> list[dict[str, Any]]:
    """Every job's row, batch by batch (each batch's sampling seeded by its index); with ``output``
    (``ResumableOutput``), the batches it already holds are skipped and each new one is appended as it is done."""
    from tqdm import tqdm

    start = output.done if output is not None else 0
    rows = []
    with tqdm(total=len(jobs), initial=start, desc="predict", unit=" img", disable=None) as bar:
        for first in range(start, len(jobs), batch_size):
            chunk = jobs[first:first + batch_size]
            predictor.seed_batch(first // batch_size)
            batch = answer_batch(predictor, chunk, frame_list_fps)
            for row, (_, _, label) in zip(batch, chunk):
                if label is not None:
                    row["label"] = label
            if output is not None:
                output.append(batch)
            rows += batch
            bar.update(len(chunk))
    return rows


def recorded_settings(args: argparse.Namespace, jobs: list[Job], preset: PromptPreset | None = None
                      ) -> dict[str, Any]:
    """What produced the predictions: the model folder and its recorded frame, the prompt, the jobs (their count
    and a digest of every source and prompt), the sampling settings and the versions. A resumed run must match it
    key for key."""
    from llamafactory_qwenvl_patch.frame.policy_record import read_policy_record
    from qwenvl_prep.pipeline.eval_report import versions

    digest = hashlib.sha256(json.dumps([[str(s) if not isinstance(s, list) else [str(p) for p in s],
                                         [prompt.text, prompt.system] if isinstance(prompt, Ask) else prompt]
                                        for s, prompt, _ in jobs]).encode()).hexdigest()
    return {"model_dir": str(Path(args.model_dir).resolve()), "policy": read_policy_record(args.model_dir),
            "prompt": prompt_record(args, jobs, preset),
            "dataset": str(Path(args.dataset).resolve()) if args.dataset else None,
            "jobs": {"count": len(jobs), "sha256": digest},
            "settings": {"backend": args.backend, "max_new_tokens": args.max_new_tokens,
                         "batch_size": args.batch_size, "temperature": args.temperature, "seed": args.seed or 0,
                         **({"tensor_parallel_size": args.tensor_parallel_size} if args.backend == "vllm" else {})},
            "versions": versions()}


def prompt_record(args: argparse.Namespace, jobs: list[Job], preset: PromptPreset | None) -> Any:
    """The prompt as the settings record it: the preset's record, the --prompt text, or the dataset's own."""
    if preset is not None:
        return preset.record()
    if args.prompt:
        return args.prompt
    systems = any(isinstance(prompt, Ask) for _, prompt, _ in jobs)
    return "the dataset's own prompts" + (", under their system prompts" if systems else "")


def warn_stored_turned(sources: list[Any]) -> None:
    """One warning when inputs given directly are stored rotated or mirrored (a photo's EXIF orientation, a phone
    clip's display matrix): the model sees the stored pixels, as training reads them (LF does not apply either), so
    the answers are in the stored pixels. A converted dataset was settled by convert's --exif / --video-rotation."""
    from llamafactory_qwenvl_patch.image_io.images import ImageError
    from llamafactory_qwenvl_patch.image_io.video import display_matrix
    from qwenvl_prep.plumbing.imageinfo import read_info

    turned = []
    for source in sources:
        if not isinstance(source, str) or "://" in source:
            continue
        try:
            if is_video(source):
                shown = display_matrix(source)
                if not shown.shown_as_stored:
                    turned.append(f"{source} (players {shown.in_words()})")
            elif (orientation := read_info(source).orientation) != 1:
                turned.append(f"{source} (EXIF orientation {orientation})")
        except (ImageError, OSError, ValueError):
            continue  # reading it for the answer names what is wrong
    if turned:
        print(f"warning: {len(turned)} input(s) are stored rotated or mirrored, first {turned[0]}: the model sees "
              "the stored pixels, as training reads them, and answers in them (orig_size is the stored size); a box "
              "drawn on the image as viewers show it would be turned", file=sys.stderr)


def is_video(source: object) -> bool:
    """A clip: a frame list (a list of images), or a file with a video suffix."""
    from qwenvl_prep.pipeline.predict import VIDEO_SUFFIXES

    return isinstance(source, list) or str(source).lower().endswith(VIDEO_SUFFIXES)


def answer_batch(predictor: object, chunk: list[tuple[object, str, object]], frame_list_fps: float | None = None
                 ) -> list[dict]:
    """Rows for a chunk of jobs in input order: its images in one ``generate``, its clips in another (frame lists
    at ``frame_list_fps``, default the model folder's recorded rate)."""
    kinds = [is_video(source) for source, _, _ in chunk]
    videos = iter(predictor.video_batch([(s, p) for (s, p, _), v in zip(chunk, kinds) if v], frame_list_fps)
                  if any(kinds) else [])
    images = iter(predictor.batch([(s, p) for (s, p, _), v in zip(chunk, kinds) if not v]) if not all(kinds) else [])
    return [next(videos) if video else next(images) for video in kinds]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The subcommand's arguments, with ``run`` as its handler."""
    pred = sub.add_parser(
        "predict",
        help="generate (transformers or vLLM) in the folder's frame and map boxes back to original pixels "
        "(JSON lines)",
        description="Resize each image, and sample and resize each video, with the model folder's pinned policies (the "
        "training frame and clock), generate, parse "
        "bbox_2d / point_2d / <|box_start|> answers and map them back to original-image pixels.",
    )
    pred.add_argument("model_dir", type=Path,
                      help="exported model folder, a full checkpoint, or a LoRA adapter folder of llamafactory-cli "
                      "train (its local base is loaded and the adapter merged in memory; the adapter's frame wins)")
    pred.add_argument("images", nargs="*", help="image or video files (.mp4, .webm, .mkv, .avi, .mov), with --prompt")
    pred.add_argument("--prompt", help="prompt for every image")
    pred.add_argument("--dataset", type=Path, help="converted dataset: its images and prompts, labels kept for eval")
    pred.add_argument("--prompt-preset", choices=PRESET_NAMES,
                      help="with --dataset (a converted ScreenSpot / RefCOCO file, or Charades-STA / ActivityNet "
                      "Captions / QVHighlights for timelens): ask each record's instruction in the words the "
                      "published numbers for the folder's family were measured with, system prompt and answer format "
                      "included (docs/evaluation.md lists the presets and their sources)")
    pred.add_argument("-o", "--output", type=Path, help="JSONL output (default: stdout), written batch by batch to "
                      "OUTPUT.partial: a stopped run started again with the same settings continues where it "
                      "stopped; the model, prompt, settings and versions are recorded in OUTPUT.settings.json (for "
                      "eval --report)")
    pred.add_argument("--backend", choices=("hf", "vllm"), default="hf",
                      help="hf: transformers generate (default; images and videos, adapter folders merged in memory); "
                      "vllm: offline vLLM in the folder's frame, images and Qwen3-VL / Qwen3.5 videos, a merged "
                      "folder (minutes faster on large sets; scripts/add_vllm.sh installs it)")
    pred.add_argument("--tensor-parallel-size", type=count(1), default=1,
                      help="--backend vllm: GPUs the engine spans (default 1)")
    pred.add_argument("--draw", type=Path, help="also draw predicted boxes on the original images into this folder")
    pred.add_argument("--max-new-tokens", type=count(1), default=128)
    pred.add_argument("--batch-size", type=count(1), default=8, help="images per generate call (left-padded)")
    pred.add_argument("--temperature", type=finite("--temperature", True, " (0 = greedy)", least=MIN_TEMPERATURE),
                      default=0.0,
                      help="0 (default): greedy, the model's one best answer; > 0: sample at this temperature (no "
                      "top-k / top-p), e.g. 1.0 as GRPO's rollouts do, to measure how often the model gives an answer, "
                      "not only whether its best answer is one")
    pred.add_argument("--seed", type=seed, help="seed of the sampling (only with --temperature > 0; default 0)")
    pred.set_defaults(func=run)
