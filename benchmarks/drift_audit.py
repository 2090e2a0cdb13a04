"""How often stock LLaMA-Factory 0.9.5 feeds Qwen2.5-VL another frame than ``smart_resize`` labels assume.

Pure arithmetic with the policy core (``stock_llamafactory_size`` is checked against the real LF pipeline in
tests/unit/integration/test_frame_consistency.py). Sizes: COCO-like, phone photos, screenshots, scans, and uniform random sides.

    .venv/bin/python benchmarks/drift_audit.py
"""

from __future__ import annotations

import json
import random

from llamafactory_qwenvl_patch.frame.families import DEFAULT_FACTOR, LF_IMAGE_DEFAULTS
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from qwenvl_prep.lf.drift import stock_llamafactory_size

GROUPS = {
    "coco_like": [(640, 480), (640, 427), (500, 375), (427, 640), (640, 640), (612, 612), (480, 640), (640, 360)],
    "phone_photo": [(4032, 3024), (3024, 4032), (4000, 3000), (3000, 4000), (4624, 3472), (4080, 3072)],
    "screenshot": [(1920, 1080), (2560, 1440), (1170, 2532), (1284, 2778), (1366, 768), (3840, 2160)],
    "scan": [(2480, 3508), (1700, 2200), (2550, 3300), (1240, 1754)],
}


def audit(sizes, image_min, image_max):
    policy = ResizePolicy(image_min, image_max)
    changed, worst = 0, 0
    for w, h in sizes:
        ours, stock = policy.model_size(h, w), stock_llamafactory_size(h, w, image_min, image_max)
        if ours != stock:
            changed += 1
            worst = max(worst, abs(ours[0] - stock[0]), abs(ours[1] - stock[1]))
    return {"images": len(sizes), "mismatched_share": round(changed / len(sizes), 3), "max_frame_diff_px": worst}


def main() -> None:
    rng = random.Random(0)
    groups = dict(GROUPS, random=[(rng.randint(28, 5000), rng.randint(28, 5000)) for _ in range(2000)])
    groups["random"] = [(w, h) for w, h in groups["random"] if max(w, h) / min(w, h) <= 150]
    result = {}
    lf_min, lf_max = LF_IMAGE_DEFAULTS["image_min_pixels"], LF_IMAGE_DEFAULTS["image_max_pixels"]
    f = DEFAULT_FACTOR
    for name, bounds in {f"lf_defaults ({lf_min}, {lf_max})": (lf_min, lf_max),
                         f"image_max_pixels=1024*{f}*{f}": (lf_min, 1024 * f * f)}.items():
        result[name] = {group: audit(sizes, *bounds) for group, sizes in groups.items()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
