"""GUI clicks and many-box detection through the real pipeline: ScreenSpot-format and multi-box files converted by
`qwenvl-prep convert --from-yaml`, trained with `llamafactory-cli train` (stage: grpo) with click, click_dense,
det_f1, box_sanity and format; every step logs the detection monitors and evaluation reports click accuracy and
mAP."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import read_log, run_cli, save_image, train_config

ORACLE = '''
from llamafactory_qwenvl_patch.grpo.rewards.builtin import click_reward, det_f1_reward


def self_click(completions, *, references, metas, orig_sizes, model_sizes, coords, **kw):
    """The reference's own click, scored as the click reward scores a completion: 1 everywhere when the truth box
    from meta (original pixels) reaches the reward in the same frame as the reference."""
    return click_reward(references, references=references, metas=metas, orig_sizes=orig_sizes,
                        model_sizes=model_sizes, coords=coords)


def self_det(completions, *, references, **kw):
    """The reference's own det_f1 on box records (1 when they reach the reward intact); click records have no boxes."""
    return [det_f1_reward([r], references=[r])[0] if "bbox_2d" in r else 1.0 for r in references]
'''


@pytest.mark.slow
def test_click_and_detection_grpo(tmp_path, tiny_model):
    data = tmp_path / "data"
    screens = [("desktop.png", 1920, 1080), ("phone.png", 1170, 2532)]
    for name, width, height in screens:
        save_image(data / name, width, height)
    save_image(data / "pets.png", 1280, 960)
    (data / "screenspot.json").write_text(json.dumps([
        {"img_filename": name, "bbox": [width // 3, height // 4, width // 8, height // 20], "instruction": f"open {i}",
         "data_type": "icon" if i % 2 else "text", "data_source": name.split(".")[0]}
        for i, (name, width, height) in enumerate(screens * 2)]))
    pets = [{"bbox_2d": [100, 100, 400, 300], "label": "cat"}, {"bbox_2d": [600, 200, 900, 600], "label": "dog"}]
    pet = json.dumps({"image": "pets.png", "question": "<image>Find every pet.", "answer": json.dumps(pets)})
    (data / "pets_raw.jsonl").write_text((pet + "\n") * 4)
    (tmp_path / "oracle.py").write_text(ORACLE)
    out = tmp_path / "run"
    rewards = f"click,click_dense,det_f1,box_sanity,format,{tmp_path / 'oracle.py'}:self_click," \
              f"{tmp_path / 'oracle.py'}:self_det"
    config = train_config(tiny_model, data, out, stage="grpo", dataset="screens,pets", eval_dataset="screens,pets",
                          image_min_pixels=64 * 28 * 28, image_max_pixels=256 * 28 * 28, max_steps=2,
                          save_steps=2, per_device_train_batch_size=2, grpo_num_generations=2, max_new_tokens=8,
                          reward_funcs=rewards, reward_weights="1,1,1,1,1,0,0", eval_strategy="steps",
                          eval_steps=2, do_eval=True, per_device_eval_batch_size=2)
    yaml_path = tmp_path / "grpo.yaml"
    yaml_path.write_text(yaml.safe_dump(config))
    for source, name in (("screenspot.json", "screens"), ("pets_raw.jsonl", "pets")):
        extra = ["--input-coords", "abs"] if name == "pets" else []
        result = run_cli(["qwenvl-prep", "convert", str(data / source), "-o", str(data / f"{name}.jsonl"),
                          "--from-yaml", str(yaml_path), "-q", *extra], None, tmp_path)
        assert result.returncode == 0, result.stderr
    result = run_cli(["llamafactory-cli", "train"], config, tmp_path / "train")
    assert result.returncode == 0, result.stderr[-4000:]
    log = read_log(out)
    steps = [row for row in log if "loss" in row]
    assert len(steps) == 2
    for row in steps:
        assert row["rewards/self_click/mean"] == 1.0 and row["rewards/self_det/mean"] == 1.0
        assert {"rewards/click/mean", "rewards/click_dense/mean", "rewards/det_f1/mean",
                "rewards/box_sanity/mean"} <= set(row)
    monitored = [row for row in steps if "monitor/whole_image_rate" in row]
    assert monitored, "no step logged the detection monitors"
    assert {"monitor/empty_answer_rate", "monitor/duplicate_rate", "monitor/count_ratio"} <= set(monitored[0])
    evals = [row for row in log if "eval_reward" in row]
    assert evals and evals[-1]["eval_rewards/self_click/mean"] == 1.0
    assert {"eval_click_acc", "eval_click_dense_mean", "eval_det/f1@0.5", "eval_det/map",
            "eval_monitor/empty_answer_rate", "eval_acc@0.5"} <= set(evals[-1])
