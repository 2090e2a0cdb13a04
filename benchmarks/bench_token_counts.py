"""Records per second of LF's tokenization step that counts image tokens (``process_messages``, what ``datasets.map``
runs on every record), with the pinned plugin's header counts against the pixel path LF 0.9.5 takes (decode,
resize, normalise), on the same records and processor, in one run::

    .venv/bin/python benchmarks/bench_token_counts.py [--family qwen3_vl] [--images 200] [--json-out F]

Screenshots at real phone, laptop and desktop sizes (PNG, like the GUI demo's), one per record, the processor pinned
to the policy as a training run pins it. Both paths must give every record the same expanded text, or it stops.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.policy_record import set_image_processor_bounds
from llamafactory_qwenvl_patch.frame.video import VideoPolicy

SIZES = [(1170, 2532), (1080, 2400), (1920, 1080), (2560, 1440), (1366, 768), (800, 1280)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3_vl", choices=sorted(FAMILIES))
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64, help="image_max_pixels in tokens (the GUI demo's 64)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    from llamafactory.data import mm_plugin
    from llamafactory.data.template import TEMPLATES
    from transformers import AutoProcessor

    from llamafactory_qwenvl_patch.integration.plugin import pinned_plugin
    from qwenvl_prep.demos.tiny_model import build_tiny_model

    family = FAMILIES[args.family]
    factor = family.factor
    policy = ResizePolicy(16 * factor * factor, args.max_tokens * factor * factor, factor)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        processor = AutoProcessor.from_pretrained(build_tiny_model(root / "model", args.family))
        set_image_processor_bounds(processor.image_processor, policy)
        video = VideoPolicy(2048, 12288, factor, 2.0, 16, family.video_clock)
        plugin = pinned_plugin(TEMPLATES[family.default_template].mm_plugin, policy, video, 2.0)
        rng = np.random.default_rng(0)
        paths = []
        for i in range(args.images):
            width, height = SIZES[i % len(SIZES)]
            path = root / f"{i}.png"
            Image.fromarray(rng.integers(0, 255, (height // 8, width // 8, 3), dtype=np.uint8)).resize(
                (width, height)).save(path)
            paths.append(str(path))
        messages = [{"role": "user", "content": "<image>Click the button."}]
        base = next(cls for cls in type(plugin).__mro__ if cls in (mm_plugin.Qwen2VLPlugin, mm_plugin.Qwen3VLPlugin))

        def pixel_counts(images, videos, audios, proc):  # LF 0.9.5's own: the pixels made to count the tokens
            return mm_plugin.Qwen2VLPlugin._get_mm_token_metadata(plugin, images, videos, audios, proc)

        def run() -> tuple[float, list[str]]:
            start = time.perf_counter()
            texts = [plugin.process_messages(messages, [path], [], [], processor)[0]["content"] for path in paths]
            return time.perf_counter() - start, texts

        header_s, header_texts = run()
        plugin._get_mm_token_metadata = pixel_counts  # the instance only: the class keeps the header counts
        pixel_s, pixel_texts = run()
        if header_texts != pixel_texts:
            raise SystemExit("the header counts and the pixel path expanded some record differently")
        result = {"family": args.family, "plugin": base.__name__, "images": args.images, "max_tokens": args.max_tokens,
                  "header_records_per_s": round(args.images / header_s, 1),
                  "pixel_records_per_s": round(args.images / pixel_s, 1),
                  "speedup": round(pixel_s / header_s, 1)}
    print(json.dumps(result))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
