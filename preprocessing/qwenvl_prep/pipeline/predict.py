"""``qwenvl-prep predict``: generate with transformers under the model folder's pinned policy, then map the answer's
boxes back to original-image pixels.

A LoRA adapter folder (``adapter_config.json``, as ``llamafactory-cli train`` writes it) works too: its local base is
loaded, the adapter merged in memory by peft, and the adapter folder's own frame (its ``qwenvl_policy.json``, else
its processor) wins over the base's. transformers 5.6 cannot load an adapter folder itself with peft 0.18 (it imports
``_maybe_shard_state_dict_for_tp``, which that peft does not have), so peft loads it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.frame.families import FAMILIES, GROUNDING_TOKENS, family_of_model
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from llamafactory_qwenvl_patch.frame.policy_record import folder_policy, folder_video, read_policy_record
from llamafactory_qwenvl_patch.frame.stamp import Stamp
from llamafactory_qwenvl_patch.frame.video import VideoPlan, VideoPolicy
from llamafactory_qwenvl_patch.image_io.images import model_input_image
from llamafactory_qwenvl_patch.image_io.processor_sizes import keep_processor_class_sizes
from llamafactory_qwenvl_patch.model_files.experts import folder_experts_load_kwargs
from llamafactory_qwenvl_patch.model_files.weights import weights_problems
from llamafactory_qwenvl_patch.scoring.answers import AnswerError, parse_answer, parse_items
from qwenvl_prep.formats.prompt_presets import PromptPreset

VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".avi", ".mov")


def adapter_base(model_dir: Path) -> Path | None:
    """The local base model of a LoRA adapter folder (None: ``model_dir`` is a whole model)."""
    config = model_dir / "adapter_config.json"
    if not config.is_file() or (model_dir / "config.json").is_file():
        return None
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    if not base or not Path(base, "config.json").is_file():
        raise ValueError(f"{model_dir} is a LoRA adapter whose base model {base!r} is not a local model folder: "
                         "export the merged model (llamafactory-cli export with adapter_name_or_path and export_dir) "
                         "and predict with the export")
    return Path(base)


MIN_TEMPERATURE = 1e-3


def processor_folder(model_dir: str | Path) -> Path:
    """Where a folder's processor is: the folder, else (an adapter folder without one) its local base."""
    model_dir = Path(model_dir)
    if (model_dir / "preprocessor_config.json").is_file():
        return model_dir
    return adapter_base(model_dir) or model_dir


def folder_family(model_dir: str | Path) -> str:
    """The family of a model folder (of an adapter folder: its base's); ValueError when it is none we know."""
    base = adapter_base(Path(model_dir))
    family = family_of_model(base or model_dir)
    if family is None:
        raise ValueError(f"{base or model_dir}/config.json is not a Qwen-VL model of a known family "
                         f"({', '.join(FAMILIES)})")
    return family


def dataset_frame_problem(model_dir: str | Path, stamp: Stamp | None) -> str | None:
    """Why this folder's answers cannot be scored against a dataset stamped ``stamp`` (None: they can). eval reads
    every answer in the dataset's convention and frame: relative 0-1000 answers fit any frame of that convention,
    model-pixel answers (Qwen2.5-VL) only the frame (and video frame) they were made in."""
    if stamp is None:
        return None
    family = folder_family(model_dir)
    convention = FAMILIES[family].coords
    if stamp.coords != convention:
        return (f"it was converted for {stamp.family} ({stamp.coords} coordinates); {model_dir} is a {family} model "
                f"answering in {convention}")
    if convention != "model":
        return None
    base = adapter_base(Path(model_dir))
    if read_policy_record(model_dir) is not None:
        policy = folder_policy(model_dir, None)
    else:
        from transformers import AutoProcessor

        keep_processor_class_sizes()
        policy = folder_policy(model_dir, AutoProcessor.from_pretrained(processor_folder(model_dir)).image_processor)
    if policy != stamp.policy:
        return (f"it was converted in the frame {stamp.policy.min_pixels}..{stamp.policy.max_pixels} pixels, "
                f"{model_dir} answers in {policy.min_pixels}..{policy.max_pixels}")
    video, _ = answering_video(model_dir, base, policy, family)
    if stamp.video is not None and video.frame_policy != stamp.video.frame_policy:
        return (f"its videos were converted in the video frame {stamp.video.min_pixels}..{stamp.video.max_pixels} "
                f"pixels, {model_dir} answers in {video.min_pixels}..{video.max_pixels}")
    return None


def answering_video(model_dir: str | Path, base: Path | None, policy: ResizePolicy, family: str
                    ) -> tuple[VideoPolicy, float]:
    """(video policy, frame-list rate) a folder answers videos in: the one it (or an adapter's base) was trained
    with; a folder trained before videos were pinned: LF's defaults."""
    found = folder_video(model_dir) or (folder_video(base) if base else None)
    default = VideoPolicy.from_lf_keys({}, policy.factor, FAMILIES[family].video_clock)
    return found or (default, default.fps)


TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))  # a Qwen tokenizer: either form loads


def require_loadable(folder: Path, base: Path | None) -> None:
    """ValueError naming every file problem a loader would stop on only after it started (transformers deep in its
    loader, vLLM once its engine is up): weights cut short or missing shards (of the folder and of an adapter's
    base), and no tokenizer files where the processor is read (transformers then asks for sentencepiece, which a
    Qwen tokenizer does not use)."""
    problems = weights_problems(folder) + (weights_problems(base) if base is not None else [])
    tokens = processor_folder(folder)
    if not any(all((tokens / name).is_file() for name in form) for form in TOKENIZER_FILES):
        problems.append(f"{tokens}: has no tokenizer files (tokenizer.json, or vocab.json with merges.txt): copy them "
                        "from the base model")
    if problems:
        raise ValueError(f"{folder} cannot be loaded: " + "; ".join(problems))


def require_chat_template(processor: Any, folder: Path) -> None:
    """Every prompt is the processor's chat template applied (as training's template writes it): a folder without
    one is refused before any weights load or any output is made, not at the first batch."""
    if processor.chat_template:
        return
    elsewhere = " (its tokenizer_config.json has one, which the processor does not read: save it as " \
        "chat_template.jinja)" if getattr(processor.tokenizer, "chat_template", None) else ""
    raise ValueError(f"{folder} has no chat template for its processor (chat_template.jinja or chat_template.json)"
                     f"{elsewhere}; predict asks in the chat format the model was trained in: copy the base model's "
                     "chat_template.jinja into the folder")


@dataclass(frozen=True)
class Ask:
    """A prompt with the system prompt its record carries (a plain ``str`` prompt has none: the chat template's
    default), so that a model trained under a system prompt is asked under it."""

    text: str
    system: str | None = None


def ask_of(prompt: str | Ask) -> Ask:
    return prompt if isinstance(prompt, Ask) else Ask(prompt)


@dataclass
class ClipBatch:
    """Clips read for one call: each prompt's chat-template text, its sampled model-input frames, its plan, and its
    (original, model) sizes as (height, width)."""

    texts: list[str]
    frames: list[list[Any]]
    plans: list[VideoPlan]
    sizes: list[tuple[tuple[int, int], tuple[int, int]]]


class FolderModel:
    """What both backends read from a model folder before loading weights: its processor, its recorded image and
    video frames (the frame guard: a processor that disagrees with the record is refused), its family's coordinate
    convention; and the row each answer becomes, boxes mapped back to original pixels."""

    def __init__(self, model_dir: str | Path, max_new_tokens: int = 128, temperature: float = 0.0,
                 seed: int = 0, preset: PromptPreset | None = None) -> None:
        if not (math.isfinite(temperature) and (temperature == 0 or temperature >= MIN_TEMPERATURE)):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} (lower ones "
                             f"sample the greedy answer in effect, and near 1e-35 the scaled logits overflow float32), "
                             f"got {temperature}")
        from transformers import AutoProcessor

        keep_processor_class_sizes()  # a folder with only min/max_pixels must not change the next one's bounds
        self.model_dir = Path(model_dir)
        base = self.base = adapter_base(self.model_dir)
        require_loadable(self.model_dir, base)
        self.processor = AutoProcessor.from_pretrained(processor_folder(self.model_dir))
        require_chat_template(self.processor, processor_folder(self.model_dir))
        self.processor.tokenizer.padding_side = "left"  # batched generation continues every prompt at its end
        self.policy = folder_policy(model_dir, self.processor.image_processor)
        self.family = family = folder_family(model_dir)
        if preset is not None and preset.family != family:
            raise ValueError(f"the prompt preset is {preset.family}'s; {model_dir} is a {family} model")
        self.preset = preset
        tokenizer = self.processor.tokenizer
        # the grounding tokens are special tokens: a decode that skipped them would drop Qwen2-VL's boxes
        kept = {tokenizer.convert_tokens_to_ids(token) for token in GROUNDING_TOKENS}
        self._dropped = set(tokenizer.all_special_ids) - kept
        self.convention = FAMILIES[family].coords
        # the video frame and clock (and frame-list rate) it was trained with
        self.video_policy, self.frame_list_fps = answering_video(model_dir, base, self.policy, family)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self._generator_seed = seed
        self._seeded = False

    def prompt_text(self, prompt: str | Ask, model_hw: tuple[int, int]) -> str:
        """The chat-template text of one image and ``prompt``, as training's template writes it (with the record's
        system prompt); under a preset with the preset's system prompt instead (told the size of the image the model
        sees, ``model_hw``) and its assistant prefill."""
        return self._chat({"type": "image"}, prompt, model_hw) + (self.preset.prefill if self.preset else "")

    def _chat(self, media: dict[str, str], prompt: str | Ask, model_hw: tuple[int, int]) -> str:
        ask = ask_of(prompt)
        messages = [{"role": "user", "content": [media, {"type": "text", "text": ask.text}]}]
        system = self.preset.system_text(model_hw[1], model_hw[0]) if self.preset else ask.system
        if system is not None:
            messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system}]})
        return self.processor.apply_chat_template(messages, add_generation_prompt=True)

    def decode(self, token_rows: list[list[int]]) -> list[str]:
        """The answers' text without padding, stop and other special tokens, but with Qwen's grounding tokens
        (Qwen2-VL's ``<|box_start|>(x1,y1),(x2,y2)<|box_end|>`` answers are made of them)."""
        from llamafactory_qwenvl_patch.grpo.rollout.tensors import decode_kept  # imports torch: not at CLI start

        return [decode_kept(self.processor.tokenizer, row, self._dropped) for row in token_rows]

    def read_clips(self, jobs: list[tuple[str, str]], frame_list_fps: float | None) -> ClipBatch:
        """Each clip sampled, sized and clocked by the folder's video policy (``frame.video``; frame lists at
        ``frame_list_fps``, default the folder's recorded rate), with its prompt's chat-template text."""
        from llamafactory_qwenvl_patch.image_io.video import probe, read_clip, rewindable

        fps = frame_list_fps or self.frame_list_fps
        batch = ClipBatch([], [], [], [])
        for video, prompt in jobs:
            video = rewindable(video)
            clip = probe(video, fps)  # the clip's size for mapping boxes back, and the plan's input
            frames, plan = read_clip(video, self.video_policy, fps, clip=clip)
            batch.texts.append(self._chat({"type": "video"}, prompt, (frames[0].height, frames[0].width)))
            batch.frames.append(frames)
            batch.plans.append(plan)
            batch.sizes.append(((clip.height, clip.width), (frames[0].height, frames[0].width)))
        return batch

    def processor_inputs(self, batch: ClipBatch) -> Any:
        """transformers' inputs for ``batch``: the processor told not to resample or resize, reading the clock from
        each plan (Qwen3's stamps from its metadata; Qwen2.5-VL's ``second_per_grid_ts`` set from the plan)."""
        inputs = self.processor(text=batch.texts, videos=batch.frames, do_sample_frames=False, do_resize=False,
                                video_metadata=[plan.metadata(len(f)) for plan, f in zip(batch.plans, batch.frames)],
                                return_tensors="pt", padding=True)
        if "second_per_grid_ts" in inputs:
            inputs["second_per_grid_ts"] = inputs["second_per_grid_ts"].new_tensor(
                [plan.second_per_grid_ts for plan in batch.plans])
        return inputs

    def video_rows(self, jobs: list[tuple[str, str]], answers: list[str], batch: ClipBatch) -> list[dict[str, Any]]:
        """The clips' rows: boxes mapped back to the clip's pixels (times, in seconds, stay as the model wrote
        them), with the frames sampled and the clip's duration."""
        rows = []
        for (video, prompt), answer, (orig_hw, model_hw), plan in zip(jobs, answers, batch.sizes, batch.plans):
            row = self._row(video, prompt, answer, orig_hw, model_hw, key="video")
            row["frames"], row["duration"] = len(plan.indices), round(plan.duration, 3)
            rows.append(row)
        return rows

    def _row(self, source: str, prompt: str | Ask, answer: str, orig_hw: tuple[int, int], model_hw: tuple[int, int],
             key: str = "image") -> dict[str, Any]:
        """One output row: the answer, both frames, and each item mapped back to original pixels (for a clip also
        the whole answer with its boxes in the clip's pixels, ``predict_orig``: a track keeps its times)."""
        generated = answer
        raw, answer, unread = self.preset.read_answer(generated) if self.preset else (answer, answer, None)
        row: dict[str, Any] = {key: str(source), "prompt": ask_of(prompt).text, "predict": answer,
                               "orig_size": [orig_hw[1], orig_hw[0]], "model_size": [model_hw[1], model_hw[0]],
                               "coords": self.convention, "items": [], "parse_error": unread}
        if raw != answer or raw != generated:
            row["raw_answer"] = raw  # the model's own words after the prefill; ``predict`` is what eval reads

        def to_orig(item: Any) -> list[float]:
            return convert_coords(item.coords, self.convention, "orig", orig_hw, model_hw, ndigits=2)

        try:
            for item in parse_items(answer):
                row["items"].append({"kind": item.kind, "label": item.label, "model": list(item.coords),
                                     "orig": to_orig(item)})
            if key == "video":
                row["predict_orig"] = parse_answer(answer).rewrite(to_orig)
        except AnswerError as exc:
            row["parse_error"] = str(exc)
        return row


class Predictor(FolderModel):
    """The transformers backend: loads a model folder once (an adapter folder merged into its base); ``__call__``
    answers one image and returns boxes in original pixels."""

    def __init__(self, model_dir: str | Path, max_new_tokens: int = 128, temperature: float = 0.0,
                 seed: int = 0, preset: PromptPreset | None = None) -> None:
        super().__init__(model_dir, max_new_tokens, temperature, seed, preset)
        import torch
        from transformers import AutoModelForImageTextToText

        from llamafactory_qwenvl_patch.frame.mrope import pin_pretrained_positions

        base = self.base
        self.model = AutoModelForImageTextToText.from_pretrained(
            base or model_dir, dtype=torch.float32, **folder_experts_load_kwargs(base or model_dir))
        if base is not None:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, model_dir).merge_and_unload()
        pin_pretrained_positions(self.model)  # as training under the plugin placed them (Qwen2/2.5-VL videos)
        self.model.eval()

    def seed_batch(self, index: int) -> None:
        """Seed torch's generator for batch ``index`` of a run (sampling only), so a run resumed at a batch samples
        what the whole run would have sampled there."""
        if self.temperature > 0:
            import torch

            torch.manual_seed(self._generator_seed * 1_000_003 + index)
            self._seeded = True

    def __call__(self, image_path: str, prompt: str) -> dict[str, Any]:
        return self.batch([(image_path, prompt)])[0]

    def batch(self, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """Answer several (image, prompt) pairs in one left-padded ``generate``: greedy by default, so each answer
        is the one it would get alone, up to float rounding; with a temperature, sampled (top-k and top-p off, the
        model's own distribution at that temperature) from torch's generator, seeded with ``seed`` at the first
        call unless ``seed_batch`` seeded it, so a run of the same jobs in the same batches repeats its answers."""
        from PIL import Image

        images, texts, sizes = [], [], []
        for image_path, prompt in jobs:
            image = model_input_image(image_path, self.policy)
            with Image.open(image_path) as original:
                sizes.append(((original.height, original.width), (image.height, image.width)))
            texts.append(self.prompt_text(prompt, (image.height, image.width)))
            images.append(image)
        inputs = self.processor(text=texts, images=images, return_tensors="pt", padding=True)
        for (image_path, _), grid, (_, model_hw) in zip(jobs, inputs["image_grid_thw"].tolist(), sizes):
            encoded_hw = self.policy.size_from_grid(grid)
            if encoded_hw != model_hw:
                raise RuntimeError(f"processor resized {image_path} again ({encoded_hw[1]}x{encoded_hw[0]} instead "
                                   f"of {model_hw[1]}x{model_hw[0]}): its bounds differ from the model's policy")
        answers = self.generate(inputs)
        return [self._row(image_path, prompt, answer, orig_hw, model_hw)
                for (image_path, prompt), answer, (orig_hw, model_hw) in zip(jobs, answers, sizes)]

    def video_batch(self, jobs: list[tuple[str, str]], frame_list_fps: float | None = None) -> list[dict[str, Any]]:
        """Answer several (clip, prompt) pairs in one ``generate``, each clip in the folder's video frame and clock."""
        batch = self.read_clips(jobs, frame_list_fps)
        return self.video_rows(jobs, self.generate(self.processor_inputs(batch)), batch)

    def generate(self, inputs: Any) -> list[str]:
        """Greedy, or sampled at the temperature from torch's generator seeded once at the first call."""
        import torch

        sampling = ({"do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": 1.0}
                    if self.temperature > 0 else {"do_sample": False})
        if self.temperature > 0 and not self._seeded:
            torch.manual_seed(self._generator_seed)
            self._seeded = True
        with torch.no_grad():
            output = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, **sampling)
        return self.decode(output[:, inputs["input_ids"].shape[1]:].tolist())
