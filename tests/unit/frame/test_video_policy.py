"""The video policy (``frame.video``) and clip reading (``image_io.video``): frames in the image frame, sampled at real
times, a clock every reader reads the same, and named errors for clips that cannot be read."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import pytest
from helpers import save_image, write_clip
from qwen_vl_utils import smart_resize

from llamafactory_qwenvl_patch.frame.policy import PolicyError
from llamafactory_qwenvl_patch.frame.video import METADATA_FPS, VideoError, VideoPolicy, frame_list_times
from llamafactory_qwenvl_patch.image_io.video import VideoFileError, probe, read_clip

QWEN25 = VideoPolicy(3136, 65536, 28, 2.0, 128, "seconds")
QWEN3 = VideoPolicy(4096, 65536, 32, 2.0, 128, "stamps")


def durations() -> list[float]:
    rng = random.Random(7)
    return [0.0, 0.04, 0.5, 1.0, 9.99, 10.0, 63.9, 64.0, 64.01, 65.0, 120.0, 300.0, 3600.0,
            *(rng.uniform(0.1, 7200.0) for _ in range(60))]


@pytest.mark.parametrize("policy", [QWEN25, QWEN3])
def test_frames_are_the_image_frame(policy):
    """Per frame ``smart_resize`` with the video bounds, so box labels convert with the same function as images."""
    for height, width in [(1080, 1920), (720, 1280), (2160, 3840), (480, 640), (1920, 1080), (180, 320), (64, 48)]:
        assert policy.frame_size(height, width) == smart_resize(height, width, policy.factor, policy.min_pixels,
                                                                policy.max_pixels)
    assert QWEN25.frame_size(1080, 1920) == (168, 336)  # stock LF trains this clip at 196x336 (video-facts.md)


@pytest.mark.parametrize("duration", durations())
def test_qwen25_clock_survives_truncation(duration):
    """transformers 5.6 places group g at ``g * int(second_per_grid_ts)`` seconds: a whole number, so every group
    sits at its first frame's real time, every frame lies in the clip and the frames fit ``video_maxlen``."""
    fps = 5.0  # the clip's own rate (a coarse one keeps 7,200-s clips quick)
    times = [k / fps for k in range(max(1, int(duration * fps)))]
    plan = QWEN25.plan(times, duration)
    spg = plan.second_per_grid_ts
    assert spg == int(spg) >= 1
    assert len(plan.indices) % 2 == 0 and len(plan.indices) <= QWEN25.frame_cap
    assert plan.group_starts == pytest.approx([g * int(spg) for g in range(plan.groups)])
    assert all(0 <= t <= max(duration, 0.0) for t in plan.times)
    assert all(times[i] <= t + 1e-6 for i, t in zip(plan.indices, plan.times))  # the frame on screen at t
    assert plan.rate <= 2.0
    if duration >= 1:  # the clip is covered to its end: the last group starts within one group of it
        assert duration - plan.group_starts[-1] <= 2 * spg + 1e-6


@pytest.mark.parametrize("duration", durations())
def test_qwen3_stamps_match_transformers(duration):
    """Qwen3-VL / Qwen3.5 read time from ``<t seconds>``: the plan's stamps are what transformers' processor writes
    from the metadata the plugin hands it, and the mean real time of each group's frames."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    times = [k / 5.0 for k in range(max(1, int(duration * 5)))]
    plan = QWEN3.plan(times, duration)
    stamps = Qwen3VLProcessor._calculate_timestamps(None, plan.frames_indices, METADATA_FPS, 2)
    assert stamps == plan.stamps  # bit for bit: the printed stamp is the same in training and in predict
    assert plan.stamps == pytest.approx([(plan.times[2 * g] + plan.times[2 * g + 1]) / 2 for g in range(plan.groups)])
    assert len(plan.indices) <= QWEN3.frame_cap
    if duration * 2 > QWEN3.frame_cap:  # long: every frame it may take, spread over the whole clip
        assert len(plan.indices) == QWEN3.frame_cap and plan.times[-1] >= duration * (1 - 2 / QWEN3.frame_cap)


def test_long_clips():
    """The measured drift of stock LF (2 minutes at 25 fps: its last group at 63 s on the model's clock, 119 s in
    the clip): the policy's last group starts at its real time."""
    plan = QWEN25.plan([k / 25 for k in range(3000)], 120.0)
    assert (plan.rate, plan.second_per_grid_ts, plan.groups) == (1.0, 2.0, 60)
    assert plan.group_starts[-1] == 118.0 and plan.times[-1] == 119.0
    assert QWEN3.plan([k / 25 for k in range(3000)], 120.0).stamps[-1] == pytest.approx(118.59, abs=0.01)


def test_frame_lists_at_their_own_rate():
    """Frames taken at 1 fps: Qwen3 stamps 0.5, 2.5, ... (LF assumed video_fps: 0.2, 1.2, ...); no frame twice."""
    plan = QWEN3.plan(frame_list_times(10, 1.0))
    assert plan.stamps == [0.5, 2.5, 4.5, 6.5, 8.5] and plan.indices == tuple(range(10))
    plan = QWEN25.plan(frame_list_times(10, 1.0))
    assert plan.group_starts == [0.0, 2.0, 4.0, 6.0, 8.0] and plan.second_per_grid_ts == 2.0
    assert QWEN25.plan(frame_list_times(3, 2.0)).indices == (0, 1, 2, 2)  # an odd count repeats its last frame


def test_variable_rate_clips_sample_the_frame_on_screen():
    times = [0.0, 0.1, 0.2, 1.4, 1.45, 2.6, 2.7]  # a stall, then a burst
    plan = QWEN3.plan(times, 3.0)
    assert plan.indices == (0, 2, 2, 4, 4, 4)  # on screen at 0.0, 0.5, 1.0, 1.5, 2.0, 2.5 s


@pytest.mark.parametrize("bad", [dict(fps=0.0), dict(fps=math.nan), dict(fps=1e-320), dict(fps=1e6),
                                 dict(max_frames=1), dict(max_frames=10**9),
                                 dict(clock="wall"), dict(min_pixels=0)])
def test_bad_policies_are_named(bad):
    with pytest.raises(PolicyError):
        VideoPolicy(**{**QWEN3.to_dict(), **bad})


@pytest.mark.parametrize("container,codec", [("mp4", "mpeg4"), ("webm", "libvpx"), ("mkv", "mpeg4")])
def test_clips_are_read_from_their_packets(tmp_path, container, codec):
    """webm and mkv headers give no frame count or duration (LF then took the first video_maxlen frames); the
    packets give every frame's time. Only the sampled frames are decoded, each in the policy's frame."""
    import av

    path = write_clip(tmp_path / f"clip.{container}", 3, 10, 96, 64, codec)
    clip = probe(path, 2.0)
    assert (clip.width, clip.height, len(clip.times)) == (96, 64, 30)
    assert clip.duration == pytest.approx(3.0, abs=1e-3)
    if container != "mp4":
        with av.open(str(path)) as c:
            assert c.streams.video[0].frames == 0  # the header that lies
    frames, plan = read_clip(path, QWEN3, 2.0)
    assert plan.indices == (0, 5, 10, 15, 20, 25) and len(frames) == 6
    assert {f.size for f in frames} == {QWEN3.frame_size(64, 96)[::-1]}
    assert frames[0].getpixel((60, 32)) != frames[-1].getpixel((60, 32))  # the bar grew: real frames, in order


def test_unreadable_clips_are_named(tmp_path):
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "text.mp4").write_text("not a video")
    (tmp_path / "folder.mp4").mkdir()
    os.mkfifo(tmp_path / "fifo.mp4")
    for name in ("empty.mp4", "text.mp4", "folder.mp4", "fifo.mp4", "missing.mp4"):
        with pytest.raises(VideoFileError, match=name):
            probe(str(tmp_path / name), 2.0)
    save_image(tmp_path / "a.png", 40, 30)
    save_image(tmp_path / "b.png", 50, 30)
    with pytest.raises(VideoFileError, match="frame 1 is 50x30, frame 0 is 40x30"):
        probe([str(tmp_path / "a.png"), str(tmp_path / "b.png")], 1.0)
    with pytest.raises(VideoFileError, match="frame 1: .*missing.png"):
        probe([str(tmp_path / "a.png"), str(tmp_path / "missing.png")], 1.0)
    with pytest.raises(VideoFileError, match="empty"):
        probe([], 1.0)
    with pytest.raises(VideoFileError, match="rate"):
        probe([str(tmp_path / "a.png")], 0.0)
    thin = [str(save_image(tmp_path / f"thin{i}.png", 4000, 16)) for i in range(2)]
    with pytest.raises(VideoError, match="thin0.png.*aspect ratio"):
        read_clip(thin, QWEN3, 2.0)


def test_a_vllm_video_request_carries_the_training_frames_and_clock(tmp_path, tiny_model_qwen3, tiny_model):
    """``vllm_video_request``: the clip's training frames (PNG, lossless) and their times as integer indices at a
    rate that prints every stamp as the plan does (a 30-fps clip needs a finer base than milliseconds only where a
    stamp would round the other way); a Qwen2.5-VL clip carries its sampled rate and the processor's
    ``video_metadata``, so vLLM's seconds per group are the plan's (issue 49); a folder without a video policy is
    refused by name."""
    import base64
    import io
    import shutil

    from PIL import Image

    from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
    from llamafactory_qwenvl_patch.frame.policy_record import write_policy_record
    from llamafactory_qwenvl_patch.image_io.video_request import (
        VideoRequestError, integer_times, server_resizes, vllm_video_request,
    )

    clip = str(write_clip(tmp_path / "c.mp4", 3, 30, 160, 96))
    stamps = VideoPolicy(256, 64 * 32 * 32, 32, 2.0, 128, "stamps")
    folder = Path(shutil.copytree(tiny_model_qwen3, tmp_path / "qwen3"))
    write_policy_record(folder, ResizePolicy(256, 4096, 32), stamps)
    part, extra = vllm_video_request(clip, folder)
    plan = probe(clip, 2.0).plan(stamps)
    frames = part["video_url"]["url"].removeprefix("data:video/jpeg;base64,").split(",")
    sizes = {Image.open(io.BytesIO(base64.b64decode(f))).size for f in frames}
    kwargs = extra["media_io_kwargs"]["video"]
    assert len(frames) == len(plan.frames_indices) == len(kwargs["frames_indices"]) and kwargs["num_frames"] == -1
    assert sizes == {tuple(reversed(stamps.frame_size(96, 160)))}
    # the tiny checkpoint's clip budget is 131,072 to 786,432 pixels: 6 frames of 96 x 160 would be upscaled, so
    # the request says do_resize false; 6 of 192 x 320 are left as they are, so it needs no processor kwargs
    assert extra["mm_processor_kwargs"] == {"do_resize": False} and server_resizes(folder, 6, 96, 160)
    assert not server_resizes(folder, 6, 192, 320)
    rate, indices = integer_times(plan)
    assert (kwargs["fps"], kwargs["frames_indices"]) == (rate, indices) and kwargs["do_sample_frames"] is False
    assert [f"<{(indices[i] / rate + indices[i + 1] / rate) / 2:.1f} seconds>" for i in range(0, len(indices), 2)] \
        == plan.stamp_texts
    seconds = Path(shutil.copytree(tiny_model, tmp_path / "qwen25"))
    clock = VideoPolicy(256, 65536, 28, 2.0, 128, "seconds")
    write_policy_record(seconds, ResizePolicy(256, 4096, 28), clock)
    part, extra = vllm_video_request(clip, seconds)
    plan = probe(clip, 2.0).plan(clock)
    kwargs = extra["media_io_kwargs"]["video"]
    assert kwargs["fps"] == plan.rate and kwargs["frames_indices"] == list(range(len(plan.indices)))
    assert 2 / (len(kwargs["frames_indices"]) / kwargs["total_num_frames"] * kwargs["fps"]) == plan.second_per_grid_ts
    assert extra["mm_processor_kwargs"]["video_metadata"] == [plan.metadata(len(plan.indices))]
    write_policy_record(seconds, ResizePolicy(256, 4096, 28))
    with pytest.raises(VideoRequestError, match="records no video policy"):
        vllm_video_request(clip, seconds)
