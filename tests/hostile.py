"""Shared by the hostile-input tests (issue 11's classes, split by the code each guards): the small frame every
test converts into, a record and one ``qwenvl-prep convert`` in-process."""

from __future__ import annotations

import json

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy

POLICY = ResizePolicy(64 * 28 * 28, 256 * 28 * 28)
RECORD = {"image": "ok.jpg", "question": "Find it.", "answer": '[{"bbox_2d": [1, 2, 30, 40]}]'}


def run_convert(tmp_path, records, *extra, name="train.json"):
    from qwenvl_prep.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    out = tmp_path / "data" / name
    code = main(["convert", str(src), "-o", str(out), "--min-pixels", str(POLICY.min_pixels), "--max-pixels",
                 str(POLICY.max_pixels), "-q", "--workers", "1", *extra])
    return code, out
