"""``qwenvl-prep demo OUT --task fields``: the field-extraction recipe on 2 CPU cores in a few minutes, on invoices
it renders itself, ending with a model that reads them.

Render invoices (A4 pages of mixed sizes and paper tones: document type, vendor, invoice number and currency, each
left off some pages) and write the
recipe's JSONL (``image_path``, ``question``, an ``answer`` object, ``meta``) -> a small random-weight model ->
``qwenvl-prep curriculum`` (two resolution stages, each converted in its own frame) -> SFT stage 1 -> SFT stage 2
(resuming) -> GRPO with ``fields,format,no_cheat`` and the blank-image control -> export -> predict -> eval. Held-out
field metrics of the untrained model, a most-common-value baseline, the SFT model and the GRPO model, and the
confident-answer rate on blank copies of the held-out pages before and after GRPO (sampled at GRPO's temperature, and
greedy), all come from the same run.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.policy_record import write_policy_record
from llamafactory_qwenvl_patch.image_io.images import blank_like
from llamafactory_qwenvl_patch.scoring.fields import confident
from qwenvl_prep.formats.converted import load_jsonl
from qwenvl_prep.demos.steps import (ONE_THREAD, export_full, losses, new_run_folder, run_step, steps_for,
                                    write_jsonl, write_yaml)
from qwenvl_prep.demos.steps import predict as predict_step
from qwenvl_prep.lf.run_spec import load_yaml

# A4 pages scanned at 50, 72 and 100 dpi: one aspect ratio, so every page resizes to the same model frame of a stage
# (84x112, then 140x196): a 1M-parameter model finds text within minutes at fixed grid sizes (the grounding demo
# measured the same for boxes), while labels and file sizes still differ from page to page. LF decodes and resizes
# every page at every step, so larger scans only cost time (decoding and resizing a batch of 8: 0.24 s at 72-150 dpi,
# 0.10 s at 50-100 dpi, measured here).
PAGE_SIZES = ((413, 585), (595, 842), (827, 1169))
STAGES = (16 * 28 * 28, 36 * 28 * 28)  # image_max_pixels of the curriculum, low to high
MIN_PIXELS = 16 * 28 * 28
# Three fields with eight values each, read from one large word (the first letters differ, so one glyph decides the
# value): what a 1M-parameter model reads within minutes. Eight values keep the most-common-value baseline near 1/8
# per field. The 3-digit invoice number (each digit its own token) is read with some seeds and not with others in the
# default budget (seed 1: 0.98; seed 0: not, nor as 2 digits); unread, a 3-digit guess is right 1 time in 900, so
# guesses barely move its score between SFT and GRPO. Dates and amounts were not learned.
DOCUMENT_TYPES = ("invoice", "receipt", "quote", "order", "bill", "statement", "proforma", "delivery")
VENDORS = ("Acme", "Globex", "Initech", "Umbrella", "Stark", "Wayne", "Hooli", "Vandelay")
CURRENCIES = ("EUR", "USD", "GBP", "CHF", "JPY", "SEK", "NOK", "AUD")
FIELDS = ("invoice_number", "document_type", "vendor", "currency")  # the fixed-length value first: fixed positions
QUESTION = "Read the invoice as JSON."
INK, GREY = (0, 0, 0), (90, 90, 90)
# In hundredths of the page height (the final frame is 196 px high): capitals ~14 px high in the title and the
# vendor, ~25 px for the number and the currency. The vendor in mixed case at 10 was not read (0.11); in capitals,
# as the title, it is (1.00). The vendor in capitals at 13 (with names of at most 6 letters) made one run learn
# nothing at all (loss 0.19 throughout): whether and when this model starts to read is fragile.
TITLE_FONT, VENDOR_FONT, VALUE_FONT = 10, 10, 18
# Scans from white paper to dark grey ones (the blank-image control's grey page, 128, is a possible page: an invoice
# with nothing on it, not an image unlike any seen in training).
PAPER_TONE = (110, 255)
# Real invoices leave fields out: each field is missing from this share of the pages (not drawn, null in the answer),
# so a model learns what an empty place on the page reads as, and an abstention is an answer it can give (without
# one, GRPO's blank control has no answer to move towards: the SFT model never samples one). At 0.15 the SFT model
# already answered a blank page with all nulls (sampled confident rate 0.00-0.40), leaving the control nothing to
# remove; at 0.06 the seed-0 model guesses on blank pages (0.84) and still reads absence on real ones (the seed-1
# model, which also reads the number, abstains: 0.01).
OMIT_SHARE = 0.06

FAMILY = "qwen2_5_vl"  # answers are JSON objects, in no frame: the family whose recipe users start from
SFT_BATCH = 8
SFT_STEPS_PER_MINUTE = 300  # both stages; measured 322 a minute on 2 idle cores with LF's start-ups (6 a second)
DEFAULT_MINUTES = 3.0  # 900 steps: the three word fields read on every page, the blank control seen acting on seed 0
# (docs/fields.md says what the earlier default, 5 minutes, added)
STAGE1_SHARE = 0.07  # of the SFT steps: the low resolution learns the answer format cheaply
MAX_TRAIN_PAGES = 1200
GRPO_STEPS, GRPO_SMOKE_STEPS = 30, 2
# GRPO's lr: 1e-4 cost a model that reads the invoice number part of it (seed 1: 0.98 -> 0.91), 5e-5 and 3e-5 kept
# it; on the seed-0 model all three took the blank rate from 0.84 to 0.01-0.05. 5e-4 cost held-out reward on an
# earlier SFT model (0.698 -> 0.674); 2e-3 broke the model.
GRPO_LR = 5.0e-5
GRPO_BLANK_RATIO = 1.0  # every prompt also on a blank copy, the control's strongest setting
GRPO_TEMPERATURE = 1.0
BLANK_SAMPLES = 4  # sampled answers per blank page (at GRPO's temperature): a rate, not one greedy bit
GRPO_PROMPTS = 64  # GRPO's own small set (max_samples): LF tokenizes the whole dataset before the first step
HELD_OUT, HELD_OUT_SMOKE = 64, 8
MAX_NEW_TOKENS = 80  # the answer is ~60 tokens: the tiny tokenizer spells most words letter by letter


def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """Pillow's own scalable font: the same glyphs on every machine, so a run's numbers do not depend on the fonts
    installed."""
    return ImageFont.load_default(size)


def render_invoice(path: Path, size: tuple[int, int], fields: dict[str, str], rng: random.Random) -> None:
    """One invoice template, as a vendor's own invoices are: the document type as a bold title, the vendor below it,
    then the invoice number and the currency in large bold type behind small grey labels, at the same place on every
    page (rendered from a PDF, not scanned)."""
    width, height = size
    unit = height / 100
    image = Image.new("RGB", size, (rng.randint(*PAPER_TONE),) * 3)
    draw = ImageDraw.Draw(image)
    label = _font(round(4 * unit))
    bold = {"fill": INK, "stroke_width": max(1, round(0.3 * unit)), "stroke_fill": INK}
    x = 0.08 * width
    if fields["document_type"] is not None:
        draw.text((x, 4 * unit), fields["document_type"].upper(), font=_font(round(TITLE_FONT * unit)), **bold)
    if fields["vendor"] is not None:
        draw.text((x, 16 * unit), fields["vendor"].upper(), font=_font(round(VENDOR_FONT * unit)), **bold)
    for row, (name, key) in enumerate((("No", "invoice_number"), ("Cur.", "currency"))):
        if fields[key] is None:
            continue
        top = (30 + 24 * row) * unit
        draw.text((x, top + 7 * unit), name, fill=GREY, font=label)
        draw.text((x + 14 * unit, top), fields[key], font=_font(round(VALUE_FONT * unit)), **bold)
    image.save(path)


def synthesise_invoices(folder: Path, count: int, seed: int) -> list[dict[str, Any]]:
    """The recipe's JSONL records for ``count`` rendered invoices (``seed`` in the file names, so sets differ)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(count):
        fields = {"invoice_number": str(rng.randint(100, 999)), "document_type": rng.choice(DOCUMENT_TYPES),
                  "vendor": rng.choice(VENDORS), "currency": rng.choice(CURRENCIES)}
        fields = {k: None if rng.random() < OMIT_SHARE else v for k, v in fields.items()}
        size = rng.choice(PAGE_SIZES)
        name = f"s{seed}_invoice{i:04d}.png"
        render_invoice(folder / name, size, fields, rng)
        records.append({"image_path": name, "question": QUESTION, "answer": {k: fields[k] for k in FIELDS},
                        "meta": {"page_size": list(size)}})
    return records


def blank_copies(folder: Path, records: list[dict[str, Any]], source: Path) -> list[dict[str, Any]]:
    """Each record again on a blank page of its image's size (the GRPO control's ``blank_like``), same answer."""
    folder.mkdir(parents=True, exist_ok=True)
    blanks = []
    for record in records:
        name = f"blank_{record['image_path']}"
        blank_like(source / record["image_path"]).save(folder / name)
        blanks.append({**record, "image_path": name})
    return blanks


def most_common_answer(records: list[dict[str, Any]]) -> dict[str, str]:
    """The baseline's one answer: each field's most common training value (the first seen among ties)."""
    return {key: Counter(r["answer"][key] for r in records if r["answer"][key] is not None).most_common(1)[0][0]
            for key in FIELDS}


def confident_rate(predictions: Path, records: list[dict[str, Any]]) -> float:
    """Share of answers that commit to a field the reference fills (``confident``, the GRPO control's test)."""
    rows = load_jsonl(predictions)
    if len(rows) != len(records):
        raise RuntimeError(f"{predictions} has {len(rows)} answers for {len(records)} pages")
    return round(sum(confident(row["predict"], r["answer"]) for row, r in zip(rows, records)) / len(records), 4)


def run_fields_demo(out: Path, minutes: float | None = None, steps: int | None = None,
                    seed: int = 0) -> dict[str, Any]:
    """Render, train (curriculum SFT, then GRPO with the blank-image control), export, predict and evaluate; ``steps``
    (SFT steps of both stages together) overrides those of ``minutes`` (default ``DEFAULT_MINUTES``); ``seed`` draws
    other invoices (training and held-out) and other initial weights, shuffles and samples."""
    steps = steps if steps is not None else max(2, steps_for(minutes or DEFAULT_MINUTES, SFT_STEPS_PER_MINUTE))
    out, logs = new_run_folder(out)
    raw = out / "raw"
    learning = steps >= 100  # fewer steps: a smoke run, with fewer pages and GRPO steps
    first = max(1, round(steps * STAGE1_SHARE))
    stage_steps = (first, max(1, steps - first))
    train = synthesise_invoices(raw, min(MAX_TRAIN_PAGES, max(64, steps * SFT_BATCH // 2)), seed=2 * seed)
    held_out = synthesise_invoices(raw, HELD_OUT if learning else HELD_OUT_SMOKE, seed=2 * seed + 1)
    blanks = blank_copies(raw / "blank", held_out, raw)
    write_jsonl(raw / "train.jsonl", train)
    write_jsonl(raw / "eval.jsonl", held_out)
    write_jsonl(raw / "blank" / "blank.jsonl", blanks)
    write_jsonl(raw / "blank" / "blank_sampled.jsonl", blanks * BLANK_SAMPLES)
    model = out / "model"
    run_step("tiny-model", ["qwenvl-prep", "tiny-model", str(model), "--family", FAMILY, "--size", "small", "--seed",
                            str(seed)], logs)
    base = write_yaml(out / "base_sft.yaml", {
        "model_name_or_path": str(model), "template": FAMILIES[FAMILY].default_template, "qwenvl_patch": True,
        "image_min_pixels": MIN_PIXELS, "image_max_pixels": STAGES[-1], "stage": "sft", "do_train": True,
        "finetuning_type": "full", "freeze_vision_tower": False, "freeze_multi_modal_projector": False,
        "cutoff_len": 512, "overwrite_cache": True, "preprocessing_num_workers": 2, "output_dir": str(out / "sft"),
        "logging_steps": max(1, steps // 40), "save_strategy": "no", "per_device_train_batch_size": SFT_BATCH,
        "dataloader_num_workers": 1,
        "learning_rate": 2.0e-3, "lr_scheduler_type": "cosine", "warmup_ratio": 0.05, "report_to": "none",
        "use_cpu": True, "save_only_model": True, "seed": seed,
    })
    run_step("curriculum", ["qwenvl-prep", "curriculum", str(raw / "train.jsonl"), "--from-yaml", str(base),
                            "--stages", ",".join(map(str, STAGES)), "--eval-input", str(raw / "eval.jsonl"),
                            "-o", str(out / "curriculum"), "-q"], logs)
    stage_yamls = [out / "curriculum" / f"stage{k}.yaml" for k in (1, 2)]
    run_step("convert-blank", ["qwenvl-prep", "convert", str(raw / "blank" / "blank.jsonl"), "-o",
                               str(out / "curriculum" / "data" / "blank.jsonl"), "--from-yaml", str(stage_yamls[1]),
                               "-q"], logs)
    run_step("convert-blank-sampled", ["qwenvl-prep", "convert", str(raw / "blank" / "blank_sampled.jsonl"), "-o",
                                       str(out / "curriculum" / "data" / "blank_sampled.jsonl"), "--from-yaml",
                                       str(stage_yamls[1]), "-q"], logs)
    final = load_yaml(stage_yamls[1])
    eval_data = Path(final["dataset_dir"]) / f"{final['eval_dataset']}.jsonl"
    blank_data = out / "curriculum" / "data" / "blank.jsonl"
    blank_sampled = out / "curriculum" / "data" / "blank_sampled.jsonl"
    policy = ResizePolicy(final["image_min_pixels"], final["image_max_pixels"], FAMILIES[FAMILY].factor)
    write_policy_record(model, policy)  # the untrained model answers in the final stage's frame
    evaluated: dict[str, dict[str, Any]] = {}
    blank_rate: dict[str, float] = {}
    blank_sampled_rate: dict[str, float] = {}

    def predict(name: str, model_dir: Path, data: Path, temperature: float = 0.0) -> Path:
        return predict_step(name, model_dir, data, out / f"predictions-{name}.jsonl", logs, MAX_NEW_TOKENS,
                            temperature, seed, ONE_THREAD)

    def blank_rates(name: str, model_dir: Path) -> None:
        blank_rate[name] = confident_rate(predict(f"blank-{name}", model_dir, blank_data), held_out)
        blank_sampled_rate[name] = confident_rate(
            predict(f"blank-sampled-{name}", model_dir, blank_sampled, GRPO_TEMPERATURE), held_out * BLANK_SAMPLES)

    def evaluate(name: str, predictions: Path) -> None:
        run_step(f"eval-{name}", ["qwenvl-prep", "eval", str(eval_data), "--predictions", str(predictions),
                                  "--json-out", str(out / f"eval-{name}.json")], logs)
        evaluated[name] = json.loads((out / f"eval-{name}.json").read_text())["fields"]

    answer = json.dumps(most_common_answer(train))
    evaluate("baseline", write_jsonl(out / "predictions-baseline.jsonl", [{"predict": answer} for _ in held_out]))
    evaluate("untrained", predict("untrained", model, eval_data))
    for k, (path, count) in enumerate(zip(stage_yamls, stage_steps), start=1):
        run_step(f"train-sft-stage{k}", ["llamafactory-cli", "train", str(path), f"max_steps={count}"], logs,
                 ONE_THREAD)
    sft = Path(final["output_dir"])
    evaluate("sft", predict("sft", sft, eval_data))
    blank_rates("sft", sft)
    grpo_yaml = write_yaml(out / "grpo.yaml", {
        **{k: v for k, v in final.items()
           if k not in ("eval_dataset", "lr_scheduler_type", "warmup_ratio", "dataloader_num_workers")},
        "model_name_or_path": str(sft), "stage": "grpo", "output_dir": str(out / "grpo"), "max_samples": GRPO_PROMPTS,
        "reward_funcs": "fields,format,no_cheat", "reward_weights": "1,0.5,1",
        "grpo_blank_image_ratio": GRPO_BLANK_RATIO,
        "grpo_num_generations": 4, "temperature": GRPO_TEMPERATURE, "max_new_tokens": MAX_NEW_TOKENS,
        "logging_steps": 1,
        "max_steps": GRPO_STEPS if learning else GRPO_SMOKE_STEPS, "per_device_train_batch_size": 4,
        "learning_rate": GRPO_LR, "grpo_log_completions": True,
    })
    run_step("train-grpo", ["llamafactory-cli", "train", str(grpo_yaml)], logs, ONE_THREAD)
    export_full(out / "grpo", out / "exported", FAMILY, policy, stage_yamls[1], logs)
    evaluate("grpo", predict("grpo", out / "exported", eval_data))
    blank_rates("grpo", out / "exported")
    grpo_log = load_jsonl(out / "grpo" / "trainer_log.jsonl")
    return {
        "task": "fields", "sft_steps": list(stage_steps), "train_pages": len(train), "held_out_pages": len(held_out),
        "held_out": evaluated, "baseline_answer": json.loads(answer), "blank_confident_rate": blank_rate,
        "blank_confident_rate_sampled": blank_sampled_rate, "blank_samples": len(held_out) * BLANK_SAMPLES,
        "stages": [{"image_max_pixels": s, "output_dir": str(out / "sft" / f"stage{k}"),
                    "sft_loss": losses(out / "sft" / f"stage{k}")} for k, s in enumerate(STAGES, start=1)],
        "grpo_reward": [row["reward"] for row in grpo_log if "reward" in row],
        "grpo_blank_confident_rate": [row.get("blank/confident_rate") for row in grpo_log if "reward" in row],
        "curriculum": str(out / "curriculum"), "model": str(model), "exported": str(out / "exported"),
        "logs": str(logs),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The held-out table a person reads at the end of the demo (the JSON summary goes to stdout)."""
    names = {"untrained": "untrained", "baseline": "most-common baseline", "sft": "after SFT",
             "grpo": "after SFT + GRPO"}
    lines = [f"held-out invoices: {summary['held_out_pages']} (SFT steps per stage {summary['sft_steps']})",
             f"{'':22}{'format ok':>10}{'fields':>8}{'exact':>7}" + "".join(f"{k[:14]:>15}" for k in FIELDS)]
    for key, name in names.items():
        m = summary["held_out"][key]
        accuracy = m["per_field_accuracy"]
        lines.append(f"{name:22}{m['format_valid_rate']:>10.2f}{m['mean_fields_reward']:>8.3f}"
                     f"{m['all_fields_exact']:>7.2f}" + "".join(f"{accuracy[k]:>15.2f}" for k in FIELDS))
    rate, sampled = summary["blank_confident_rate"], summary["blank_confident_rate_sampled"]
    lines.append(f"confident answers on blank pages, sampled at temperature {GRPO_TEMPERATURE:g} "
                 f"({summary['blank_samples']} answers): {sampled['sft']:.2f} after SFT, {sampled['grpo']:.2f} after "
                 f"GRPO; greedy: {rate['sft']:.2f} after SFT, {rate['grpo']:.2f} after GRPO")
    return "\n".join(lines)
