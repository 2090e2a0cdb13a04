"""``qwenvl-prep demo OUT --task gui``: click grounding for GUI agents on CPU, on screenshots it draws itself.

Draw app-like screenshots at real screen sizes (desktop 1920x1080, laptop 1280x800, phone 1170x2532, tablet
1920x1200) with labelled buttons (``text``) and icons (``icon``), written as a ScreenSpot annotation file (``bbox``
as left, top, width, height; ``instruction`` "click <label>"; ``data_type``, ``platform``) -> ``qwenvl-prep convert``
(answers as ``point_2d`` in the model's frame, the truth box in ``meta``) -> check -> a small random-weight model ->
``llamafactory-cli train`` (SFT from scratch, then GRPO with click, click_dense and format) -> export -> predict ->
click accuracy on held-out screenshots by platform and element type, next to the untrained model and the training
set's mean click point, all measured in the same run -> the clicks drawn on the original screenshots.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any, Iterator

import cv2
import numpy as np

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from llamafactory_qwenvl_patch.scoring.clicks import click_hit, click_point
from qwenvl_prep.formats.converted import load_jsonl
from qwenvl_prep.demos.steps import (ONE_THREAD, convert_and_check, export_full, full_training, grpo_stage, losses,
                                    new_run_folder, predict, run_step, sft_stage, small_model, write_jsonl,
                                    write_yaml)

SCREENS = {"desktop": (1920, 1080), "laptop": (1280, 800), "phone": (1170, 2532), "tablet": (1920, 1200)}
# One colour and one icon shape per label, on every screen: at the demo's bounds a 1920x1080 screenshot becomes a
# 288x160 model input for Qwen3-VL, 280x168 for Qwen2.5-VL (7x smaller), where label text is a few grey pixels; a ~1M-parameter model finds the element by
# its colour, which the instruction's label names (a real model would also read the text, which is drawn too).
LABELS = {"Delete": (50, 50, 210), "Save": (60, 170, 60), "Search": (210, 110, 40), "Share": (30, 150, 250),
          "Settings": (170, 60, 150), "Home": (170, 170, 30)}
SHAPES = {"Delete": "cross", "Save": "square", "Search": "circle", "Share": "triangle", "Settings": "diamond",
          "Home": "house"}
# One control per screenshot by default, large, against a screen edge (a toolbar, a side bar, a bottom bar): the
# small model, trained in-process on the same screens (held-out click accuracy after 800 steps), learned that (0.58)
# but not 1-3 controls placed anywhere (0.105, under the mean click's 0.125) nor controls half this size (0.015). At
# the edges the mean click lands on content, so the baseline is near 0 and the demo's test also asks an absolute
# accuracy. Learning starts late and suddenly: 600 steps gave 0.15 to 0.41 by the draw, 1,200 steps 0.77 through LF.
# Two controls at the edges (--controls 2), the instruction naming one, through LF (Qwen3-VL, seeds 0 and 1): 0.67 and
# 0.79 after 3,120 steps (2,400 screenshots) with 0.16 and 0.06 of the instructions clicked on the other control (told
# apart); an earlier build with 1,200 screenshots gave 0.28 and 0.23 after 1,300 steps, with 0.26 and 0.12 (found,
# hardly told apart).
MAX_CONTROLS = 3  # the most that fit at the edges of every screen size, large as above (tested)
BUTTON_SIZE = ((0.3, 0.5), (0.15, 0.25))  # button width and height in shares of sqrt(screen width x height)
ICON_SIZE = (0.2, 0.3)  # icon side in the same unit
CLUTTER = (2, 5)  # grey paragraphs and panels per screen
FONT = cv2.FONT_HERSHEY_SIMPLEX


@dataclass(frozen=True)
class Element:
    label: str
    kind: str  # "text" (a button with its label) or "icon" (a shape, its label written below)
    box: tuple[int, int, int, int]  # x1, y1, x2, y2 in original pixels (x2, y2 exclusive)


def _text(canvas: np.ndarray, text: str, centre: tuple[int, int], height: int, color: tuple[int, int, int],
          width: int | None = None) -> None:
    """``text`` centred on ``centre``, about ``height`` pixels tall and at most ``width`` wide."""
    scale = height / cv2.getTextSize("Hg", FONT, 1.0, 1)[0][1]
    if width is not None:
        scale = min(scale, width / cv2.getTextSize(text, FONT, 1.0, 1)[0][0])
    thickness = max(1, round(scale * 2))
    (tw, th), _ = cv2.getTextSize(text, FONT, scale, thickness)
    cv2.putText(canvas, text, (centre[0] - tw // 2, centre[1] + th // 2), FONT, scale, color, thickness, cv2.LINE_AA)


def _icon(canvas: np.ndarray, shape: str, box: tuple[int, int, int, int], color: tuple[int, int, int]) -> None:
    """An app icon: a tile in the label's colour with the label's glyph in white."""
    x1, y1, x2, y2 = box
    cx, cy, r = (x1 + x2) // 2, (y1 + y2) // 2, min(x2 - x1, y2 - y1) // 4
    cv2.rectangle(canvas, (x1, y1), (x2 - 1, y2 - 1), color, -1)
    white = (255, 255, 255)
    points = {
        "triangle": [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)],
        "diamond": [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)],
        "house": [(cx, cy - r), (cx + r, cy), (cx + r, cy + r), (cx - r, cy + r), (cx - r, cy)],
        "square": [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)],
    }
    if shape == "circle":
        cv2.circle(canvas, (cx, cy), r, white, max(2, r // 3), cv2.LINE_AA)
    elif shape == "cross":
        cv2.line(canvas, (cx - r, cy - r), (cx + r, cy + r), white, max(2, r // 3), cv2.LINE_AA)
        cv2.line(canvas, (cx - r, cy + r), (cx + r, cy - r), white, max(2, r // 3), cv2.LINE_AA)
    else:
        cv2.fillPoly(canvas, [np.array(points[shape], np.int32)], white, cv2.LINE_AA)


def _free(box: tuple[int, int, int, int], taken: list[tuple[int, int, int, int]], gap: int) -> bool:
    return all(box[2] + gap <= t[0] or t[2] + gap <= box[0] or box[3] + gap <= t[1] or t[3] + gap <= box[1]
               for t in taken)


def _edge_position(rng: random.Random, width: int, height: int, w: int, h: int, bar: int, gap: int
                   ) -> tuple[int, int]:
    """A top-left corner that puts a ``w`` x ``h`` element against one screen edge (a toolbar, a side bar, a bottom
    navigation bar), anywhere along it, as apps place their controls; the middle holds the content."""
    x, y = rng.randint(gap, width - w - gap), rng.randint(bar + gap, height - h - gap)
    side = rng.choice(("top", "bottom", "left", "right"))
    if side == "top":
        return x, bar + gap
    if side == "bottom":
        return x, height - h - gap
    return (gap if side == "left" else width - w - gap), y


def draw_screen(size: tuple[int, int], rng: random.Random, controls: int = 1) -> tuple[np.ndarray, list[Element]]:
    """One app-like screenshot: a title bar, grey text lines and panels, and ``controls`` controls with distinct
    labels that never overlap (fewer where they do not fit)."""
    width, height = size
    short = min(width, height)
    canvas = np.full((height, width, 3), rng.randint(236, 252), np.uint8)
    bar = round(short * 0.08)
    cv2.rectangle(canvas, (0, 0), (width - 1, bar), (rng.randint(50, 90),) * 3, -1)
    _text(canvas, rng.choice(("Files", "Mail", "Notes", "Photos", "Calendar")), (width // 2, bar // 2), bar // 3,
          (235, 235, 235))
    for _ in range(rng.randint(*CLUTTER)):  # clutter in greys: paragraphs and panels
        x, y = rng.randint(0, width - short // 4), rng.randint(bar + 4, height - short // 20)
        if rng.random() < 0.3:
            cv2.rectangle(canvas, (x, y), (x + rng.randint(short // 6, short // 2), y + rng.randint(short // 10, short // 4)),
                          (rng.randint(215, 230),) * 3, -1)
        else:
            for line in range(rng.randint(1, 4)):
                top = y + line * short // 30
                cv2.rectangle(canvas, (x, top), (x + rng.randint(short // 8, short // 3), top + short // 90),
                              (rng.randint(150, 190),) * 3, -1)
    elements: list[Element] = []
    taken: list[tuple[int, int, int, int]] = []  # element boxes with their labels below
    gap = short // 40
    scale = (width * height) ** 0.5  # element sizes follow the screen's area, so every shape gets alike targets
    # randint(n, n) is n, but it draws from rng: kept so that every screen, and the numbers in docs/gui-detection.md, stay the same
    for label in rng.sample(list(LABELS), rng.randint(controls, controls)):
        kind = rng.choice(("text", "icon"))
        if kind == "text":
            w, h = round(scale * rng.uniform(*BUTTON_SIZE[0])), round(scale * rng.uniform(*BUTTON_SIZE[1]))
        else:
            w = h = round(scale * rng.uniform(*ICON_SIZE))
        w = min(w, width - 2 * gap)
        below = round(h * 0.35) if kind == "icon" else 0  # the icon's label under it, outside its box
        for _ in range(100):
            x1, y1 = _edge_position(rng, width, height, w, h + below, bar, gap)
            box = (x1, y1, x1 + w, y1 + h)
            if _free((x1, y1, x1 + w, y1 + h + below), taken, gap):
                break
        else:
            continue
        if kind == "text":
            cv2.rectangle(canvas, box[:2], (box[2] - 1, box[3] - 1), LABELS[label], -1)
            _text(canvas, label, ((box[0] + box[2]) // 2, (box[1] + box[3]) // 2), h // 3, (255, 255, 255),
                  w * 4 // 5)
        else:
            _icon(canvas, SHAPES[label], box, LABELS[label])
            _text(canvas, label, ((box[0] + box[2]) // 2, box[3] + below // 2), below // 2, (70, 70, 70))
        elements.append(Element(label, kind, box))
        taken.append((x1, y1, x1 + w, y1 + h + below))
    return canvas, elements


@dataclass(frozen=True)
class Shot:
    """One screenshot on disk and every element on it."""

    name: str
    platform: str
    size: tuple[int, int]
    elements: tuple[Element, ...]


def synthesise_screens(folder: Path, seed: int, controls: int = 1) -> Iterator[Shot]:
    """Screenshots without end, the platforms in turn, each with ``controls`` controls (fewer where they do not fit),
    each written when it is drawn. Written as JPEG, not PNG as
    most screenshots are: LF decodes every image at every step, and a 3-megapixel PNG decodes about 3.5x slower than
    a JPEG (measured here), which would double a step of the small model."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    platforms = list(SCREENS)
    for i in count():
        platform = platforms[i % len(platforms)]
        canvas, elements = draw_screen(SCREENS[platform], rng, controls)
        name = f"s{seed}_{i:04d}_{platform}.jpg"
        cv2.imwrite(str(folder / name), canvas, [cv2.IMWRITE_JPEG_QUALITY, 90])
        yield Shot(name, platform, SCREENS[platform], tuple(elements))


def screenspot_entries(shots: Iterator[Shot], total: int, per_shot: int, seed: int
                       ) -> list[tuple[dict[str, Any], Shot]]:
    """``total`` ScreenSpot annotations (``bbox`` as left, top, width, height in original pixels), up to
    ``per_shot`` per screenshot, each naming another element on it, each with the screenshot it belongs to."""
    rng = random.Random(seed)
    entries: list[tuple[dict[str, Any], Shot]] = []
    while len(entries) < total:
        shot = next(shots)
        for element in rng.sample(list(shot.elements), min(per_shot, len(shot.elements), total - len(entries))):
            x1, y1, x2, y2 = element.box
            entries.append(({"img_filename": shot.name, "bbox": [x1, y1, x2 - x1, y2 - y1],
                             "instruction": f"click {element.label}", "data_type": element.kind,
                             "data_source": "synthetic", "platform": shot.platform}, shot))
    return entries


def write_screenspot(path: Path, entries: list[tuple[dict[str, Any], Shot]]) -> Path:
    path.write_text(json.dumps([entry for entry, _ in entries], indent=1))
    return path


PROMPT = "{instruction}. Answer with its point_2d in JSON."
MIN_PIXELS, MAX_PIXELS = 32 * 28 * 28, 64 * 28 * 28
SFT_BATCH = 8
# Qwen3-VL by default: its vision tower adds learned absolute position embeddings, interpolated to each grid, and the
# small model found the controls on every seed tried (held-out click accuracy through LF: 0.86 and 0.95 after
# 1,300 SFT steps, seeds 0 and 2; 0.81 after 1,000, seed 1; seed 0 had 0.42 after 990). Qwen2.5-VL's positions are
# relative only (RoPE): its learning starts late and suddenly, at a step that varies by seed (1,200 steps: 0.77 on
# seed 0, 0.09 on seed 1 after SFT; in-process on the same screens, 0.76 and 0.19 on two other seeds).
DEFAULT_FAMILY = "qwen3_vl"
SFT_STEPS_PER_MINUTE = 390  # measured on 2 idle CPU cores, with ONE_THREAD and no gradient checkpointing (6.5 a second)
DEFAULT_MINUTES = 1300 / SFT_STEPS_PER_MINUTE  # the 1,300 steps every seed above was measured with
# SFT trains on one thread (ONE_THREAD) while its dataloader worker decodes and resizes the next screenshots (1-3 MP
# each, 7-29 ms in fetch_image, a third of a step's work) on the other core. LF checkpoints gradients by default,
# which computes every forward twice: a tenth of a step of this small model, whose activations are no burden.
MAX_TRAIN = 1200
MAX_NEW_TOKENS = 32  # a point answer is about 20 tokens
GRPO_STEPS, GRPO_SMOKE_STEPS = 6, 2
GRPO_PROMPTS = 64
HELD_OUT, HELD_OUT_SMOKE = 100, 8


def mean_click_predictions(train: list[tuple[dict[str, Any], Shot]], held_out: list[tuple[dict[str, Any], Shot]],
                           image_dir: Path, policy: ResizePolicy, convention: str) -> list[dict[str, Any]]:
    """The constant baseline: the training set's mean click point (the box centres, as shares of the screen's
    sides) clicked on every held-out screenshot, written as ``qwenvl-prep predict`` rows in the model's convention."""
    shares = [((x + w / 2) / shot.size[0], (y + h / 2) / shot.size[1])
              for (x, y, w, h), shot in ((entry["bbox"], shot) for entry, shot in train)]
    mx, my = (sum(column) / len(shares) for column in zip(*shares))
    rows = []
    for entry, shot in held_out:
        width, height = shot.size
        model_hw = policy.model_size(height, width)
        point = convert_coords([mx * width, my * height], "orig", convention, (height, width), model_hw)
        rows.append({"image": str(image_dir / entry["img_filename"]), "predict": json.dumps([{"point_2d": point}]),
                     "orig_size": [width, height], "model_size": [model_hw[1], model_hw[0]], "coords": convention})
    return rows


def other_control_rate(held_out: list[tuple[dict[str, Any], Shot]], rows: list[dict[str, Any]]) -> float:
    """The share of held-out instructions clicked on a control the instruction did not name: with several controls
    per screen, what tells a model that reads the instruction (its clicks on the named control) from one that finds
    controls and picks one (as many clicks on the others). The click and the hit are eval's: ``click_point`` of the
    answer, mapped to original pixels unrounded, inside a box edges included. The named control is the one whose box
    is the instruction's ``bbox``. ``rows`` are ``qwenvl-prep predict`` rows."""
    if len(rows) != len(held_out):
        raise ValueError(f"{len(rows)} predictions for {len(held_out)} held-out instructions")
    wrong = 0
    for (entry, shot), row in zip(held_out, rows):
        point = click_point(row["predict"])
        if point is None:
            continue
        (width, height), (model_w, model_h) = row["orig_size"], row["model_size"]
        x, y = convert_coords(list(point), row["coords"], "orig", (height, width), (model_h, model_w), ndigits=None)
        left, top, w, h = entry["bbox"]
        wrong += any(element.box != (left, top, left + w, top + h) and click_hit((x, y), element.box)
                     for element in shot.elements)
    return wrong / len(rows) if rows else 0.0


def run_gui_demo(out: Path, steps: int, family: str = DEFAULT_FAMILY, seed: int = 0, controls: int = 1
                 ) -> dict[str, Any]:
    """The GUI demo (see the module's docstring) with ``steps`` SFT steps; under 50 is a smoke run (fewer
    held-out screenshots and GRPO steps). ``seed`` draws the screenshots and the initial model; ``controls`` per
    screenshot (the instruction names one) makes the instruction matter, at the price of more steps."""
    out, logs = new_run_folder(out)
    data, raw = out / "data", out / "raw"
    learning = steps >= 50
    # one instruction per screenshot, so the cap on screenshots grows with the controls a screenshot holds
    train = screenspot_entries(synthesise_screens(raw, 2 * seed, controls),
                               min(MAX_TRAIN * controls, max(64, steps * SFT_BATCH)), 1, seed=2 * seed)
    held_out = screenspot_entries(synthesise_screens(raw, 2 * seed + 1, controls),
                                  HELD_OUT if learning else HELD_OUT_SMOKE, 1, seed=2 * seed + 1)
    write_screenspot(raw / "train.json", train)
    write_screenspot(raw / "grpo.json", train[:GRPO_PROMPTS])
    write_screenspot(raw / "eval.json", held_out)
    policy = ResizePolicy(MIN_PIXELS, MAX_PIXELS, FAMILIES[family].factor)
    model = small_model(out / "model", family, policy, logs, seed)
    common = full_training(family, data, "gui_train", policy)
    sft_yaml = write_yaml(out / "sft.yaml", {**sft_stage(common, model, out / "sft", steps, SFT_BATCH),
                                             "dataloader_num_workers": 1, "dataloader_persistent_workers": True,
                                             "disable_gradient_checkpointing": True})
    converted = convert_and_check({split: raw / f"{split}.json" for split in ("train", "grpo", "eval")}, data, "gui",
                                  sft_yaml, ["--format", "screenspot", "--target", "point", "--prompt", PROMPT], logs)
    evaluated: dict[str, Any] = {}

    def evaluate(name: str, model_dir: Path | None) -> None:
        predictions = out / f"predictions-{name}.jsonl"
        if model_dir is not None:
            predict(name, model_dir, converted["eval"], predictions, logs, MAX_NEW_TOKENS)
        report = out / f"eval-{name}.json"
        run_step(f"eval-{name}", ["qwenvl-prep", "eval", str(converted["eval"]), "--predictions", str(predictions),
                                  "--by", "platform,data_type", "--json-out", str(report)], logs)
        result = json.loads(report.read_text())
        evaluated[name] = {"overall": {**result["clicks"],
                                       "other_control_rate": other_control_rate(held_out, load_jsonl(predictions))},
                           "by": {group: value["clicks"] for group, value in result["by"].items()}}

    write_jsonl(out / "predictions-baseline.jsonl",
                mean_click_predictions(train, held_out, raw, policy, FAMILIES[family].coords))
    evaluate("baseline", None)
    evaluate("untrained", model)
    run_step("train-sft", ["llamafactory-cli", "train", str(sft_yaml)], logs, ONE_THREAD)
    evaluate("sft", out / "sft")
    grpo_yaml = write_yaml(out / "grpo.yaml", grpo_stage(common, out / "sft", out / "grpo", "gui_grpo",
                                                         "click,click_dense,format",
                                                         GRPO_STEPS if learning else GRPO_SMOKE_STEPS,
                                                         MAX_NEW_TOKENS))
    run_step("train-grpo", ["llamafactory-cli", "train", str(grpo_yaml)], logs)
    export_full(out / "grpo", out / "exported", family, policy, sft_yaml, logs)
    evaluate("grpo", out / "exported")
    run_step("draw", ["qwenvl-prep", "draw", str(converted["eval"]), "-o", str(out / "drawn"), "--sample", "16",
                      "--predictions", str(out / "predictions-grpo.jsonl")], logs)
    grpo_log = load_jsonl(out / "grpo" / "trainer_log.jsonl")
    rewards = [[row.get(f"rewards/{name}/mean") for row in grpo_log if "reward" in row] for name in ("click", "click_dense")]
    sft_loss = losses(out / "sft")
    return {"task": "gui", "family": family, "seed": seed, "controls": controls, "sft_steps": steps,
            "train_instructions": len(train),
            "held_out_instructions": len(held_out), "click": evaluated,
            "sft_loss_first_last": [sft_loss[0], sft_loss[-1]] if sft_loss else None,
            "grpo_click_reward_first_last": [rewards[0][0], rewards[0][-1]],
            "grpo_click_dense_reward_first_last": [rewards[1][0], rewards[1][-1]],
            "data": str(data), "exported": str(out / "exported"), "drawn": str(out / "drawn"), "logs": str(logs)}


def format_gui_summary(summary: dict[str, Any]) -> str:
    """The held-out click table a person reads at the end of the demo (the JSON summary goes to stdout)."""
    names = {"untrained": "untrained", "baseline": "mean-click baseline", "sft": "SFT", "grpo": "SFT + GRPO"}
    groups = sorted(summary["click"]["grpo"]["by"])
    short = [group.replace("platform=", "").replace(", data_type=", " ") for group in groups]
    lines = [f"held-out instructions: {summary['held_out_instructions']} ({summary['family']}, "
             f"{summary['sft_steps']} SFT steps, {summary['controls']} control(s) a screen): click accuracy overall "
             "and by platform and element type; 'other control': clicks on a control the instruction did not name",
             f"{'':20}{'overall':>8}{'other control':>15}" + "".join(f"{name:>15}" for name in short)]
    for key, name in names.items():
        result = summary["click"][key]
        lines.append(f"{name:20}{result['overall']['click_acc']:>8.2f}{result['overall']['other_control_rate']:>15.2f}"
                     + "".join(f"{result['by'][group]['click_acc']:>15.2f}" for group in groups))
    lines.append(f"clicks (red) and target boxes (green) on the original screenshots: {summary['drawn']}")
    return "\n".join(lines)
