"""docs/figures/drift.png: one label (a button) on a 2560x1440 desktop screenshot, converted into the frame users convert labels for
(``qwen_vl_utils.smart_resize``, LF's default bounds) and drawn where stock LLaMA-Factory 0.9.5
trains the model to put it (its own frame: area truncation, then the processor's rounding). Every size and
coordinate comes from the project's frame core and drift audit::

    .venv/bin/python docs/figures/drift.py
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from llamafactory_qwenvl_patch.frame.families import LF_IMAGE_DEFAULTS
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords
from qwenvl_prep.lf.drift import stock_llamafactory_size

ORIGINAL = (1440, 2560)  # height, width: a desktop screenshot
BOX = [2160, 1270, 2480, 1390]  # a button near the far corner, in original pixels
SHOWN = 2  # the figure is the screenshot at half size
OUT = Path(__file__).with_name("drift.png")


def main() -> None:
    policy = ResizePolicy(LF_IMAGE_DEFAULTS["image_min_pixels"], LF_IMAGE_DEFAULTS["image_max_pixels"])
    bounds = f"{math.isqrt(policy.min_pixels)}*{math.isqrt(policy.min_pixels)}.." \
             f"{math.isqrt(policy.max_pixels)}*{math.isqrt(policy.max_pixels)}"
    label_hw = policy.model_size(*ORIGINAL)  # the frame labels are converted for
    stock_hw = stock_llamafactory_size(*ORIGINAL, policy.min_pixels, policy.max_pixels)  # what stock LF feeds
    label = convert_coords(BOX, "orig", "model", ORIGINAL, label_hw)  # the label as written in the dataset
    learned = convert_coords(label, "model", "orig", ORIGINAL, stock_hw)  # where that label sits on stock LF's input
    height, width = (side // SHOWN for side in ORIGINAL)
    image = Image.new("RGB", (width, height), (236, 238, 242))  # a plain window: title bar, text lines, the button
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, 0, width, 44], fill=(52, 58, 70))
    for row in range(12):
        draw.rectangle([60, 240 + 32 * row, 60 + (row * 97 % 500) + 300, 252 + 32 * row], fill=(200, 204, 212))
    font = ImageFont.load_default(size=22)
    scaled = lambda box: [v / SHOWN for v in box]  # noqa: E731
    draw.rectangle(scaled(BOX), fill=(60, 110, 220))
    draw.rectangle(scaled(BOX), outline=(40, 190, 70), width=5)
    draw.rectangle(scaled(learned), outline=(220, 40, 40), width=5)
    shift = max(abs(a - b) for a, b in zip(BOX, learned))
    lines = [f"{ORIGINAL[1]}x{ORIGINAL[0]} screenshot, LF's default bounds ({bounds})",
             f"label frame (smart_resize): {label_hw[1]}x{label_hw[0]}; stock LF feeds {stock_hw[1]}x{stock_hw[0]}",
             "green: the button and its label", f"red: where stock LF trains the model to answer (off by up to "
             f"{shift:.0f} original px)", "with qwenvl_patch: true the two frames are the same"]
    for i, text in enumerate(lines):
        draw.text((20, 60 + 30 * i), text, fill=(20, 20, 20), font=font)
    image.save(OUT, optimize=True)
    print(OUT, label_hw, stock_hw, [round(v) for v in learned])


if __name__ == "__main__":
    main()
