"""Field extraction end to end through the real tools: ``qwenvl-prep convert`` of the JSONL recipe, then
``llamafactory-cli train`` with ``stage: grpo``, the fields / no_cheat rewards, the blank-image control, record
``meta`` reaching a reward, accumulation over a batch of 2, and field metrics in the evaluation."""

from __future__ import annotations

import json

import pytest
from helpers import read_log, run_cli, save_image, train_config

from qwenvl_prep.cli import main

pytestmark = pytest.mark.slow

META_REWARD = '''
def meta_seen(completions, *, metas, indices, **kw):
    """1 when the record's meta arrived decoded and belongs to this record."""
    return [1.0 if isinstance(m, dict) and m["serial"] == m["expect"] else 0.0 for m in metas]
'''


@pytest.fixture(scope="module")
def fields_run(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("fields")
    raw = root / "raw"
    records = []
    for i, size in enumerate([(600, 800), (800, 600), (500, 700), (700, 500)] * 2):
        save_image(raw / f"invoice{i}.png", *size, color=(250, 250, 245))
        records.append({"image_path": f"invoice{i}.png", "question": "Extract invoice_number, date and total as JSON.",
                        "answer": {"invoice_number": f"INV-{i}", "date": f"2024-06-1{i}", "total": 100 + i},
                        "meta": {"serial": i, "expect": i, "vendor": "ACME" if i % 2 else 7}})
    (raw / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data = root / "data"
    min_pixels, max_pixels = 64 * 28 * 28, 256 * 28 * 28
    assert main(["convert", str(raw / "train.jsonl"), "-o", str(data / "invoices.jsonl"), "--min-pixels",
                 str(min_pixels), "--max-pixels", str(max_pixels), "-q", "--workers", "1"]) == 0
    (root / "rewards.py").write_text(META_REWARD)
    out = root / "grpo"
    config = train_config(
        tiny_model, data, out, stage="grpo", dataset="invoices", image_min_pixels=min_pixels,
        image_max_pixels=max_pixels, max_steps=2, save_steps=2, grpo_num_generations=4, max_new_tokens=16,
        temperature=1.0, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        reward_funcs=f"fields,fields_raw,format,no_cheat,{root / 'rewards.py'}:meta_seen",
        reward_weights="1,0,0.5,1,0", no_cheat_min_length_ratio=0.3, grpo_blank_image_ratio=1.0,
        grpo_blank_image_penalty=2, val_size=0.5, do_eval=True, eval_strategy="steps", eval_steps=2,
        per_device_eval_batch_size=2, grpo_log_completions=True)
    result = run_cli(["llamafactory-cli", "train"], config, root / "run")
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def test_fields_rewards_blank_control_and_meta_are_logged(fields_run):
    steps = [row for row in read_log(fields_run) if "loss" in row]
    assert len(steps) == 2
    for row in steps:
        assert 0 <= row["rewards/fields/mean"] <= 1 and row["rewards/fields_raw/mean"] >= row["rewards/fields/mean"]
        assert -1 <= row["rewards/no_cheat/mean"] <= 0
        assert row["rewards/meta_seen/mean"] == 1.0  # every record's meta reached the reward, decoded
        assert 0 <= row["blank/confident_rate"] <= 1
    rows = [json.loads(line) for line in (fields_run / "completions.jsonl").read_text().splitlines()]
    blank = [row for row in rows if row["blank"]]
    assert blank and len(blank) < len(rows) and all(row["reward"] in (0.0, -2.0) for row in blank)


def test_field_metrics_in_the_evaluation(fields_run):
    metrics = json.loads((fields_run / "eval_results.json").read_text())
    for key in ("eval_fields/all_fields_exact", "eval_fields/format_valid_rate", "eval_fields/parse_failure_rate",
                "eval_fields/acc/invoice_number", "eval_fields/acc/total", "eval_blank/confident_rate",
                "eval_rewards/fields/mean"):
        assert 0 <= metrics[key] <= 1, key
    assert metrics["eval_samples"] == 4
