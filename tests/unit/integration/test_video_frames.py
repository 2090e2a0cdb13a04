"""Videos through LF's real get_dataset and collator, with the model's own M-RoPE: every frame group has the policy's
grid and token count, and sits at its real time on the model's clock (Qwen2.5-VL's temporal positions in seconds,
Qwen2-VL's group index, Qwen3-VL and Qwen3.5's ``<t seconds>`` stamps), for mp4, webm, mkv and frame lists, several videos in one message and videos in
later turns; stock LF does not."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from helpers import lf_sft_dataset, save_image, write_clip, write_sharegpt

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.mrope import pin_pretrained_positions
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.image_io.video import probe

pytestmark = pytest.mark.slow  # LF's dataset pipeline and a tiny model per family

VIDEO_MIN, VIDEO_MAX = 3136, 65536
TEMPLATES = {"qwen2_5_vl": "qwen2_vl", "qwen2_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl_nothink",
             "qwen3_5": "qwen3_5_nothink"}
COLUMNS = {"messages": "messages", "videos": "videos"}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """A 10-s mp4, a 7-s webm (no frame count in its header), a 3-s mkv, and six frames taken at 1 fps."""
    data = tmp_path_factory.mktemp("videos")
    write_clip(data / "a.mp4", 10, 30, 320, 180)
    write_clip(data / "b.webm", 7, 25, 256, 256, codec="libvpx")
    write_clip(data / "c.mkv", 3, 24, 200, 120)
    for i in range(6):
        save_image(data / f"f{i}.png", 200, 150, (40 * i, 0, 0))
    turn = {"role": "assistant", "content": '{"span": [1.0, 2.0]}'}
    records = [
        {"messages": [{"role": "user", "content": "<video>When does the bar pass the middle?"}, turn],
         "videos": ["a.mp4"]},
        {"messages": [{"role": "user", "content": "<video> and <video>: which is longer?"}, turn],
         "videos": ["b.webm", "c.mkv"]},
        {"messages": [{"role": "user", "content": "<video>First?"}, turn, {"role": "user", "content": "<video>Then?"},
                      turn], "videos": ["c.mkv", "a.mp4"]},
    ]
    write_sharegpt(data, "clips", records, COLUMNS)
    frames = [{"messages": [{"role": "user", "content": "<video>When?"}, turn],
               "videos": [[f"f{i}.png" for i in range(6)]]}]
    write_sharegpt(data, "frames", frames, COLUMNS)  # LF cannot merge frame lists with files in one dataset
    return data


def collate(model_dir: Path, data: Path, out: Path, family: str, dataset: str, patch: bool = True
            ) -> tuple[list[dict], list[list[str]], Any]:
    """LF's pipeline in-process, the collator with the model (for M-RoPE positions); one batch per record."""
    from llamafactory.data import MultiModalDataCollatorForSeq2Seq
    from transformers import AutoModelForImageTextToText

    module, template, dataset_rows = lf_sft_dataset(
        model_dir, data, out, template=TEMPLATES[family], dataset=dataset, qwenvl_patch=patch,
        video_min_pixels=VIDEO_MIN, video_max_pixels=VIDEO_MAX, qwenvl_frame_list_fps=1.0, cutoff_len=16384)
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    if patch:  # what the plugin's load_model does: Qwen2/2.5-VL positions as pretrained
        pin_pretrained_positions(model)
    collator = MultiModalDataCollatorForSeq2Seq(template=template, model=model, pad_to_multiple_of=8, **module)
    batches = [collator([dataset_rows[i]]) for i in range(len(dataset_rows))]
    tokenizer = module["tokenizer"]
    texts = [tokenizer.decode(batch["input_ids"][0]) for batch in batches]
    return batches, texts, model


def plans(data: Path, videos: list, family: str) -> list:
    f = FAMILIES[family]
    policy = VideoPolicy(VIDEO_MIN, VIDEO_MAX, f.factor, 2.0, 128, f.video_clock)
    out = []
    for video in videos:
        clip = probe([str(data / v) for v in video] if isinstance(video, list) else str(data / video), 1.0)
        out.append((clip.plan(policy), policy.frame_size(clip.height, clip.width), policy))
    return out


VIDEOS = [["a.mp4"], ["b.webm", "c.mkv"], ["c.mkv", "a.mp4"]]


def check_grids(batch: dict, expected: list, vpad: int) -> None:
    patch = expected[0][2].factor // 2
    grid = [[plan.groups, h // patch, w // patch] for plan, (h, w), _ in expected]
    assert batch["video_grid_thw"].tolist() == grid
    assert int((batch["input_ids"] == vpad).sum()) == sum(g * h * w // 4 for g, h, w in grid)


def check_text_after_videos(batch: dict, vpad: int) -> None:
    """The first token after every video block sits at the largest position so far + 1 in all three sections, where
    each family was pretrained to see it (issue 49: transformers 5.6 put Qwen2/2.5-VL's inside the video's time)."""
    ids, positions = batch["input_ids"][0], batch["position_ids"][:, 0]
    real = batch["attention_mask"][0].bool()
    after = [i for i in range(1, len(ids)) if ids[i - 1] == vpad and ids[i] != vpad and real[i]]
    assert after
    for i in after:
        assert positions[:, i].tolist() == [int(positions[:, :i].max()) + 1] * positions.size(0)


@pytest.mark.parametrize("family,fixture", [("qwen2_5_vl", "tiny_model"), ("qwen2_vl", "tiny_model_qwen2"),
                                            ("qwen3_vl", "tiny_model_qwen3"), ("qwen3_5", "tiny_model_qwen3_5")])
def test_every_frame_group_in_its_frame_and_at_its_time(request, family, fixture, clips, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    batches, texts, model = collate(model_dir, clips, tmp_path / "out", family, "clips")
    vpad = model.config.video_token_id
    for batch, text, videos in zip(batches, texts, VIDEOS):
        expected = plans(clips, videos, family)
        check_grids(batch, expected, vpad)
        check_text_after_videos(batch, vpad)
        if family == "qwen2_5_vl":  # M-RoPE: group g of each video at tokens_per_second x its real start time
            assert list(batch["second_per_grid_ts"]) == [plan.second_per_grid_ts for plan, _, _ in expected]
            tps = model.config.vision_config.tokens_per_second
            temporal = batch["position_ids"][0, 0][batch["input_ids"][0] == vpad]
            start = 0
            for plan, (h, w), _ in expected:
                per_group = h * w // 28 // 28
                firsts = temporal[start:start + plan.groups * per_group:per_group]
                assert (firsts - firsts[0]).tolist() == [round(tps * t) for t in plan.group_starts]
                start += plan.groups * per_group
        elif family == "qwen2_vl":  # M-RoPE counts groups: group g of each video at temporal position g
            temporal = batch["position_ids"][0, 0][batch["input_ids"][0] == vpad]
            start = 0
            for plan, (h, w), _ in expected:
                per_group = h * w // 28 // 28
                firsts = temporal[start:start + plan.groups * per_group:per_group]
                assert (firsts - firsts[0]).tolist() == list(range(plan.groups))
                start += plan.groups * per_group
        else:  # the stamps before each group: each video's own, in order
            stamps = re.findall(r"<([\d.]+) seconds>", text)
            assert stamps == [f"{s:.1f}" for plan, _, _ in expected for s in plan.stamps]
    if family == "qwen3_vl":
        batches, texts, _ = collate(model_dir, clips, tmp_path / "frames", family, "frames")
        expected = plans(clips, [[f"f{i}.png" for i in range(6)]], family)
        check_grids(batches[0], expected, vpad)
        assert re.findall(r"<([\d.]+) seconds>", texts[0]) == ["0.5", "2.5", "4.5"]  # taken at 1 fps


def test_stock_llamafactory_drifts(tiny_model, clips, tmp_path):
    """Documents the bug: without the plugin the 320x180 mp4 is seen at another size, and the webm (no frame count in
    its header) as its first 128 frames, at a clock that says 63 s for a frame at about 5 s."""
    batches, _, _ = collate(tiny_model, clips, tmp_path / "stock", "qwen2_5_vl", "clips", patch=False)
    expected = plans(clips, ["a.mp4"], "qwen2_5_vl")[0]
    stock = batches[0]["video_grid_thw"][0].tolist()
    assert (stock[1] * 14, stock[2] * 14) != expected[1]
    webm = batches[1]["video_grid_thw"][0].tolist()
    assert webm[0] == 64 != plans(clips, ["b.webm"], "qwen2_5_vl")[0][0].groups
    last_group_at = (webm[0] - 1) * int(batches[1]["second_per_grid_ts"][0])
    assert last_group_at == 63 and probe(str(clips / "b.webm"), 1.0).duration == pytest.approx(7.0, abs=0.05)
