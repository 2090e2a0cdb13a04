"""``qwenvl-prep demo OUT --task fields``: the field-extraction recipe on CPU, on invoices it renders itself.

Render invoice-like images with PIL (invoice number, date and total at varying positions, sizes and fonts) and write
the recipe's JSONL (``image_path``, ``question``, an ``answer`` object, ``meta``) -> tiny model -> ``qwenvl-prep
curriculum`` (two resolution stages, each converted in its own frame) -> SFT stage 1 -> SFT stage 2 (resuming) ->
GRPO with ``fields,format,no_cheat`` and the blank-image control -> export -> predict -> eval (field metrics).
"""

from __future__ import annotations

import glob
import json
import random
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from qwenvl_prep.dataset import load_jsonl
from qwenvl_prep.demo_steps import new_run_folder, run_step, write_jsonl, write_yaml
from qwenvl_prep.run_spec import load_yaml

SIZES = [(620, 877), (877, 620), (1240, 1754), (800, 1000), (1000, 700), (595, 842)]
STAGES = (64 * 28 * 28, 256 * 28 * 28)  # image_max_pixels of the curriculum, low to high
MIN_PIXELS = 32 * 28 * 28
QUESTION = ("Read the invoice and answer in JSON with the keys invoice_number, date and total, for example "
            '{"invoice_number": "...", "date": "YYYY-MM-DD", "total": "..."}.')
VENDORS = ("ACME GmbH", "Globex Ltd", "Initech", "Umbrella SA", "Stark & Co")


def _fonts() -> list[str]:
    """TrueType fonts on this machine (PIL's built-in font when there are none)."""
    found = sorted(glob.glob("/usr/share/fonts/**/*.ttf", recursive=True))
    return [f for f in found if "Mono" in f or "Sans" in f or "Serif" in f][:12] or found[:12]


def _font(fonts: list[str], rng: random.Random, size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.truetype(rng.choice(fonts), size) if fonts else ImageFont.load_default(size)


def render_invoice(path: Path, size: tuple[int, int], fields: dict[str, str], vendor: str, rng: random.Random,
                   fonts: list[str]) -> None:
    """Black text on an off-white page: a header, the vendor, the three fields in a shuffled order and position."""
    width, height = size
    image = Image.new("RGB", size, (rng.randint(240, 255),) * 3)
    draw = ImageDraw.Draw(image)
    scale = min(width, height) / 600
    draw.text((int(40 * scale), int(30 * scale)), "INVOICE", fill=(20, 20, 20),
              font=_font(fonts, rng, int(48 * scale)))
    draw.text((int(40 * scale), int(95 * scale)), vendor, fill=(60, 60, 60), font=_font(fonts, rng, int(24 * scale)))
    lines = [("Invoice No", fields["invoice_number"]), ("Date", fields["date"]), ("Total", fields["total"])]
    rng.shuffle(lines)
    y = rng.randint(int(170 * scale), int(height * 0.45))
    x = rng.randint(int(30 * scale), int(width * 0.3))
    font = _font(fonts, rng, int(rng.randint(26, 34) * scale))
    for label, value in lines:
        draw.text((x, y), f"{label}: {value}", fill=(0, 0, 0), font=font)
        y += int(rng.randint(45, 70) * scale)
    image.save(path)


def synthesise_invoices(folder: Path, count: int, seed: int = 0) -> list[dict[str, Any]]:
    """The recipe's JSONL records for ``count`` rendered invoices."""
    rng = random.Random(seed)
    fonts = _fonts()
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(count):
        fields = {"invoice_number": f"INV-{rng.randint(1000, 9999)}",
                  "date": f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                  "total": f"{rng.randint(10, 9999)}.{rng.randint(0, 99):02d}"}
        vendor = rng.choice(VENDORS)
        name = f"invoice{i:03d}.png"
        render_invoice(folder / name, SIZES[i % len(SIZES)], fields, vendor, rng, fonts)
        records.append({"image_path": name, "question": QUESTION, "answer": fields, "meta": {"vendor": vendor}})
    return records


def run_fields_demo(out: Path, steps: int = 4) -> dict[str, Any]:
    out, logs = new_run_folder(out)
    records = synthesise_invoices(out / "raw", 12)
    write_jsonl(out / "raw" / "train.jsonl", records[:8])
    write_jsonl(out / "raw" / "eval.jsonl", records[8:])
    run_step("tiny-model", ["qwenvl-prep", "tiny-model", str(out / "model")], logs)
    base = write_yaml(out / "base_sft.yaml", {
        "model_name_or_path": str(out / "model"), "template": "qwen2_vl", "qwenvl_patch": True,
        "image_min_pixels": MIN_PIXELS, "image_max_pixels": STAGES[-1], "stage": "sft", "do_train": True,
        "finetuning_type": "lora", "lora_target": "all", "cutoff_len": 1024, "overwrite_cache": True,
        "preprocessing_num_workers": 1, "output_dir": str(out / "sft"), "logging_steps": 1, "save_steps": steps,
        "max_steps": steps, "per_device_train_batch_size": 2, "learning_rate": 5.0e-4, "report_to": "none",
        "use_cpu": True,
    })
    run_step("curriculum", ["qwenvl-prep", "curriculum", str(out / "raw" / "train.jsonl"), "--from-yaml", str(base),
                            "--stages", ",".join(map(str, STAGES)), "--eval-input", str(out / "raw" / "eval.jsonl"),
                            "-o", str(out / "curriculum"), "-q"], logs)
    stage = [load_yaml(out / "curriculum" / f"stage{k}.yaml") for k in (1, 2)]
    for k in (1, 2):
        run_step(f"train-sft-stage{k}", ["llamafactory-cli", "train", str(out / "curriculum" / f"stage{k}.yaml")],
                 logs)
    final = stage[1]
    grpo_yaml = write_yaml(out / "grpo.yaml", {
        **{k: v for k, v in final.items() if k not in ("eval_dataset",)},
        "stage": "grpo", "adapter_name_or_path": final["output_dir"], "output_dir": str(out / "grpo"),
        "reward_funcs": "fields,format,no_cheat", "reward_weights": "1,0.5,1", "grpo_blank_image_ratio": 0.5,
        "grpo_num_generations": 4, "temperature": 1.0, "max_new_tokens": 48, "max_steps": 2, "save_steps": 2,
        "per_device_train_batch_size": 1, "learning_rate": 1.0e-4, "grpo_log_completions": True,
    })
    run_step("train-grpo", ["llamafactory-cli", "train", str(grpo_yaml)], logs)
    export_yaml = write_yaml(out / "export.yaml", {
        "model_name_or_path": str(out / "model"), "template": "qwen2_vl", "qwenvl_patch": True,
        "image_min_pixels": final["image_min_pixels"], "image_max_pixels": final["image_max_pixels"],
        "adapter_name_or_path": str(out / "grpo"), "finetuning_type": "lora", "export_dir": str(out / "exported"),
        "export_size": 1, "export_device": "cpu",
    })
    run_step("export", ["llamafactory-cli", "export", str(export_yaml)], logs)
    eval_data = Path(final["dataset_dir"]) / f"{final['eval_dataset']}.jsonl"
    predictions = out / "predictions.jsonl"
    run_step("predict", ["qwenvl-prep", "predict", str(out / "exported"), "--dataset", str(eval_data), "-o",
                         str(predictions), "--max-new-tokens", "64"], logs)
    run_step("eval", ["qwenvl-prep", "eval", str(eval_data), "--predictions", str(predictions), "--json-out",
                      str(out / "eval.json"), "--plot", str(out / "eval.png")], logs)
    grpo_log = load_jsonl(out / "grpo" / "trainer_log.jsonl")
    return {
        "task": "fields", "curriculum": str(out / "curriculum"), "model": str(out / "model"),
        "exported": str(out / "exported"), "predictions": str(predictions), "eval": str(out / "eval.json"),
        "logs": str(logs),
        "stages": [{"image_max_pixels": s["image_max_pixels"], "output_dir": s["output_dir"],
                    "sft_loss": [row["loss"] for row in load_jsonl(Path(s["output_dir"]) / "trainer_log.jsonl")
                                 if "loss" in row]} for s in stage],
        "metrics": json.loads((out / "eval.json").read_text())["fields"],
        "grpo_checkpoint": str(out / "grpo"),
        "grpo_reward": [row["reward"] for row in grpo_log if "loss" in row],
        "grpo_blank_confident_rate": [row.get("blank/confident_rate") for row in grpo_log if "loss" in row],
    }
