"""``qwenvl-prep predict``: batched generation answers as one image at a time does, in each image's own frame."""

from __future__ import annotations

import shutil

from helpers import save_image

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.policy_record import write_policy_record
from qwenvl_prep.predict import Predictor


def test_batched_answers_equal_single_ones(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    policy = ResizePolicy(16 * 28 * 28, 64 * 28 * 28)
    write_policy_record(model, policy)
    sizes = [(640, 480), (300, 900), (1000, 1000), (200, 150), (1600, 400)]  # different prompt lengths once padded
    jobs = [(str(save_image(tmp_path / f"i{k}.jpg", w, h)), f"Locate object {k} in the image.")
            for k, (w, h) in enumerate(sizes)]
    predictor = Predictor(model, max_new_tokens=12)
    batched = predictor.batch(jobs)
    single = [predictor(image, prompt) for image, prompt in jobs]
    assert [row["predict"] for row in batched] == [row["predict"] for row in single]
    for row, (w, h) in zip(batched, sizes):
        assert row["orig_size"] == [w, h]
        assert row["model_size"] == list(reversed(policy.model_size(h, w)))
