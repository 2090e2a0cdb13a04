"""Stock LLaMA-Factory's video path, restated as pure functions in ``qwenvl_prep.lf.drift`` (the frame, the sampled
frames, ``second_per_grid_ts``, where transformers puts each group, Qwen3's stamps), checked against LF 0.9.5's
real ``Qwen2VLPlugin`` / ``Qwen3VLPlugin`` methods and transformers' ``get_rope_index`` on real clips (mp4, webm); and
the video drift benchmark end to end on a small grid."""

from __future__ import annotations

import importlib.util
import json
import re
from functools import partial
from pathlib import Path

import pytest
from helpers import write_clip

from qwenvl_prep.lf.drift import (
    FrameList,
    VideoHeader,
    stock_llamafactory_video,
    stock_llamafactory_video_indices,
)

ROOT = Path(__file__).resolve().parents[3]
# LF's defaults; a run whose video_maxlen binds (second_per_grid_ts 1.25, truncated to 1) and whose pre-fit shrinks
KEYS = [{"video_min_pixels": 256, "video_max_pixels": 65536, "video_fps": 2.0, "video_maxlen": 128},
        {"video_min_pixels": 256, "video_max_pixels": 16384, "video_fps": 1.5, "video_maxlen": 16}]
# The HF video processor's bounds: the tiny models' (the class defaults: Qwen2's minimum upscales every frame,
# Qwen3's budget over all frames binds) and the hub checkpoints' (set on the instance)
BOUNDS = {"qwen2_5_vl": [None, (3136, 12845056)], "qwen3_vl": [None, (4096, 25165824)]}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    """A 10-s mp4 (frame count and duration in its header), a 7-s webm (neither; more frames than video_maxlen) and
    a 3-s webm (fewer frames than LF's 128 indices)."""
    data = tmp_path_factory.mktemp("clips")
    return {"mp4": write_clip(data / "a.mp4", 10, 30, 320, 180),
            "webm": write_clip(data / "b.webm", 7, 25, 256, 144, codec="libvpx"),
            "short_webm": write_clip(data / "c.webm", 3, 25, 200, 120, codec="libvpx")}


def header(path: Path) -> tuple[VideoHeader, object]:
    """What LF reads of the clip, the way LF reads it; the container stays open for LF's own method."""
    import av

    container = av.open(str(path))
    stream = next(s for s in container.streams if s.type == "video")
    duration = None if stream.duration is None else float(stream.duration * stream.time_base)
    decoded = sum(1 for _ in container.decode(stream))
    return VideoHeader(stream.width, stream.height, stream.frames, duration, float(stream.average_rate),
                       decoded), (container, stream)


def processor_with(model_dir: Path, keys: dict, bounds: tuple[int, int] | None):
    """The model's processor as LF's ``patch_processor`` leaves it, with the video processor's bounds optionally
    replaced on the instance."""
    from transformers import AutoProcessor
    from transformers.image_utils import SizeDict

    processor = AutoProcessor.from_pretrained(model_dir)
    for key, value in keys.items():
        setattr(processor, key, value)
    if bounds:
        kind = type(processor.video_processor.size)  # a SizeDict in transformers 5.x, a dict in 4.57
        processor.video_processor.size = (kind if kind is dict else SizeDict)(shortest_edge=bounds[0],
                                                                              longest_edge=bounds[1])
    size = processor.video_processor.size  # a SizeDict in transformers 5.x, a dict in 4.57
    get = size.get if isinstance(size, dict) else partial(getattr, size)
    return processor, (get("shortest_edge"), get("longest_edge"))


@pytest.mark.parametrize("family,fixture", [("qwen2_5_vl", "tiny_model"), ("qwen3_vl", "tiny_model_qwen3")])
def test_stock_functions_are_lfs_video_path(request, family, fixture, clips):
    from llamafactory.data.mm_plugin import get_mm_plugin
    from transformers import AutoModelForImageTextToText

    model_dir = request.getfixturevalue(fixture)
    plugin = get_mm_plugin("qwen2_vl" if family == "qwen2_5_vl" else "qwen3_vl", image_token="<|image_pad|>",
                           video_token="<|video_pad|>")
    model = AutoModelForImageTextToText.from_pretrained(model_dir) if family == "qwen2_5_vl" else None
    for name, path in clips.items():
        clip, (container, stream) = header(path)
        if name != "mp4":  # LF's "infinite video": its first video_maxlen indices, whatever the clip holds
            assert clip.frames == 0 and clip.duration is None
        for keys in KEYS:
            indices = plugin._get_video_sample_indices(stream, video_fps=keys["video_fps"],
                                                       video_maxlen=keys["video_maxlen"])
            assert stock_llamafactory_video_indices(clip.frames, clip.duration, keys["video_fps"],
                                                    keys["video_maxlen"]) == list(indices), (name, keys)
            for bounds in BOUNDS[family]:
                processor, used = processor_with(model_dir, keys, bounds)
                stock = stock_llamafactory_video(clip, family, processor_bounds=used, **keys)
                check_against_lf(plugin, processor, model, path, stock, (name, keys, bounds))
        container.close()


def check_against_lf(plugin, processor, model, path: Path, stock, where) -> None:
    patch = processor.video_processor.patch_size
    regular = plugin._regularize_videos([str(path)], image_max_pixels=processor.video_max_pixels,
                                        image_min_pixels=processor.video_min_pixels, video_fps=processor.video_fps,
                                        video_maxlen=processor.video_maxlen)
    assert len(regular["videos"][0]) == len(stock.times), where  # the frames decoded, padded to even
    mm = plugin._get_mm_inputs([], [str(path)], [], processor)
    grid = mm["video_grid_thw"][0].tolist()
    assert grid == [stock.groups, stock.frame[0] // patch, stock.frame[1] // patch], where
    if model is not None:  # Qwen2.5-VL: second_per_grid_ts, then where transformers' M-RoPE puts each group
        import torch

        assert mm["second_per_grid_ts"][0] == pytest.approx(stock.second_per_grid_ts), where
        per_group = grid[1] * grid[2] // 4
        count = grid[0] * per_group
        config = model.config
        ids = torch.tensor([[config.vision_start_token_id, *[config.video_token_id] * count,
                             config.vision_end_token_id]])
        types = torch.tensor([[0, *[2] * count, 0]])
        positions, _ = model.model.get_rope_index(ids, types, video_grid_thw=mm["video_grid_thw"],
                                                  second_per_grid_ts=torch.tensor(mm["second_per_grid_ts"]))
        firsts = positions[0, 0, 1:1 + count:per_group]
        tps = config.vision_config.tokens_per_second
        assert (firsts - firsts[0]).tolist() == [round(tps * p) for p in stock.positions], where
    else:  # Qwen3: the <t seconds> stamps LF writes before each group, and each group's token count
        text = plugin.process_messages([{"role": "user", "content": "<video>When?"}], [], [str(path)], [],
                                       processor)[0]["content"]
        assert re.findall(r"<([\d.]+) seconds>", text) == [f"{s:.1f}" for s in stock.stamps], where
        assert text.count("<|video_pad|>") == stock.groups * grid[1] * grid[2] // 4, where


def test_clock_facts():
    """The measured drift of ``video-facts.md``, from the pure functions: Qwen2.5-VL's last group at 63 s for a
    2-minute clip (119 s real), a webm's first 128 frames placed up to 63 s though they span 4.2 s, and a 1-fps
    frame list read at 2 fps by Qwen3."""
    two_minutes = stock_llamafactory_video(VideoHeader(1920, 1080, 3000, 120.0, 25.0))
    assert (two_minutes.second_per_grid_ts, two_minutes.positions[-1], two_minutes.group_starts[-1]) == (1.875, 63, 119)
    assert two_minutes.frame == (196, 336)  # the frame of video-facts.md's table, at video_max_pixels 65,536
    webm = stock_llamafactory_video(VideoHeader(1920, 1080, 0, None, 30.0, decoded=300))
    assert (len(webm.indices), webm.positions[-1]) == (128, 63) and webm.group_starts[-1] == pytest.approx(4.2)
    frames = stock_llamafactory_video(FrameList(640, 480, 6, 1.0), "qwen3_vl")
    assert frames.stamps == (0.25, 1.25, 2.25) and frames.real_means == [0.5, 2.5, 4.5]


def test_the_benchmark_runs(tmp_path):
    spec = importlib.util.spec_from_file_location("video_drift_audit", ROOT / "benchmarks" / "video_drift_audit.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out, table = tmp_path / "audit.json", tmp_path / "audit.md"
    result = bench.main(["--sizes", "1920x1080,640x480", "--lengths", "10,120", "--rates", "30",
                         "--max-pixels", "65536", "--json", str(out), "--markdown", str(table)])
    assert json.loads(out.read_text()) == result
    rows = result["results"]
    assert {(r["family"], r["container"]) for r in rows} == {
        (f, c) for f in ("qwen2_5_vl", "qwen3_vl") for c in ("mp4", "webm/mkv", "frame list at 1 fps")}
    for row in rows:
        assert row["clips"] == 4  # 2 sizes x 2 lengths (x 1 rate; a frame list has its own)
        assert row["policy"]["clock_off_share"] == 0 and row["policy"]["cut_short_share"] == 0
    mp4 = next(r for r in rows if r["family"] == "qwen2_5_vl" and r["container"] == "mp4")
    assert mp4["frame_differs_share"] == 1.0 and mp4["stock"]["worst_last_group_error_s"] > 50  # 2 min: 63 vs 119 s
    assert "| qwen2_5_vl |" in table.read_text()
