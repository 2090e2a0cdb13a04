"""``qwenvl-prep`` on video data: convert (LF records with videos, the video-span and video-track formats), check and
draw, and hostile clips. Boxes go into the video policy's frame exactly as an image's go into the image frame; times
stay in seconds and must lie in the clip."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import cv2
import pytest
from helpers import save_image, write_clip

from llamafactory_qwenvl_patch.frame.families import FAMILIES
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy, convert_coords, retarget_coords
from llamafactory_qwenvl_patch.frame.stamp import Stamp
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.image_io.video import probe
from qwenvl_prep.cli import main

IMAGE_MIN, IMAGE_MAX = 3136, 200704
VIDEO_MIN, VIDEO_MAX = 256, 4096  # a 96x64 clip's video frame (28x56 at factor 28) is not its image frame (56x84)
HW = (64, 96)
FLAGS = ["--min-pixels", IMAGE_MIN, "--max-pixels", IMAGE_MAX, "--video-min-pixels", VIDEO_MIN,
         "--video-max-pixels", VIDEO_MAX, "-q", "--workers", "1"]
TRACK = '[{"time": 0.50, "bbox_2d": [10, 8, 60, 50], "label": "bar"},  {"time": 1.5, "bbox_2d": [20, 10, 90, 60]}]'
TRACK_TEMPLATE = ('[{{"time": 0.50, "bbox_2d": [{}, {}, {}, {}], "label": "bar"}},  '
                  '{{"time": 1.5, "bbox_2d": [{}, {}, {}, {}]}}]')


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("media")
    write_clip(raw / "clip.mp4", 2, 10, 96, 64)
    write_clip(raw / "clip.webm", 2, 10, 96, 64, "libvpx")
    for i in range(6):
        save_image(raw / "frames" / f"f{i}.jpg", 96, 64)
    return raw


def frame_list(count: int = 6) -> list[str]:
    return [f"frames/f{i}.jpg" for i in range(count)]


def sharegpt(video, answer: str, question: str = "<video>Track the bar.") -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            "videos": [video]}


def write_input(folder: Path, name: str, records: list) -> Path:
    path = folder / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def convert(capsys, src: Path, out: Path, *args, flags: list = FLAGS) -> tuple[int, dict, dict]:
    """(exit code, summary, error rows by record) of one convert run."""
    code = main(["convert", str(src), "-o", str(out), *map(str, flags), *map(str, args)])
    summary = json.loads(capsys.readouterr().out)
    errors = {}
    if summary.get("error_report"):
        errors = {row["record"]: row for row in map(json.loads, Path(summary["error_report"]).read_text().splitlines())}
    return code, summary, errors


def records(path: Path) -> list[dict]:
    return json.loads(path.read_text())


def entry(path: Path) -> dict:
    return json.loads((path.parent / "dataset_info.json").read_text())[path.stem]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("kind", ["mp4", "webm", "frames"])
def test_boxes_go_into_the_video_frame_and_times_stay(tmp_path, media, capsys, family, kind):
    fam = FAMILIES[family]
    video = frame_list() if kind == "frames" else f"clip.{kind}"
    src = write_input(media, f"in-{family}-{kind}.jsonl", [sharegpt(video, TRACK)])
    out = tmp_path / "data" / "train.json"
    code, summary, _ = convert(capsys, src, out, "--input-coords", "abs", "--family", family, "--frame-list-fps", 2)
    assert code == 0 and summary["written"] == 1 and summary["timed_boxes"] == 2, summary
    policy = VideoPolicy(VIDEO_MIN, VIDEO_MAX, fam.factor, 2.0, 128, fam.video_clock)
    frame = policy.frame_size(*HW)
    assert frame != ResizePolicy(IMAGE_MIN, IMAGE_MAX, fam.factor).model_size(*HW)  # not vacuous
    expected = [v for box in ([10, 8, 60, 50], [20, 10, 90, 60])
                for v in convert_coords(box, "orig", fam.coords, HW, frame)]
    written = records(out)[0]
    assert written["messages"][1]["content"] == TRACK_TEMPLATE.format(*expected)  # all else byte for byte
    assert written["messages"][0]["content"] == "<video>Track the bar."
    assert written["images"] == []
    if kind == "frames":
        assert written["videos"] == [[str(media / p) for p in frame_list()]]
    else:
        assert written["videos"] == [str(media / video)]
    info = entry(out)
    assert info["columns"]["videos"] == "videos"
    stamp = Stamp.from_dict(info["qwenvl_policy"])
    assert stamp.video == policy and stamp.coords == fam.coords
    assert stamp.frame_list_fps == (2.0 if kind == "frames" else None)


def test_alpaca_and_sharegpt_keep_every_character(tmp_path, media, capsys):
    span = '{ "span" : [0.50,1.5] }'
    src = write_input(media, "mixed.jsonl", [
        {"instruction": "When does the bar grow?", "output": span, "videos": ["clip.mp4"], "system": "S"},
    ])
    out = tmp_path / "data" / "alpaca.json"
    code, summary, _ = convert(capsys, src, out, "--format", "alpaca")
    assert code == 0 and summary["spans"] == 1
    written = records(out)[0]
    assert [m["content"] for m in written["messages"]] == ["S", "<video>When does the bar grow?", span]
    sg = write_input(media, "sg.jsonl", [
        {"conversations": [{"from": "human", "value": "<video>When?"}, {"from": "gpt", "value": span}],
         "videos": "clip.webm", "meta": {"id": 7}},
    ])
    out = tmp_path / "data" / "sg.json"
    assert convert(capsys, sg, out)[0] == 0  # no coordinates: no --input-coords needed
    written = records(out)[0]
    assert written["messages"][1]["content"] == span
    assert json.loads(written["meta"]) == {"id": 7, "duration": 2.0}  # the clip's length, for rewards and eval


def test_temporal_span_format(tmp_path, media, capsys):
    src = write_input(media, "spans.jsonl", [
        {"video": "clip.mp4", "query": "the bar grows", "timestamp": [0.5, 1.5], "duration": 2.0, "id": "a1"},
        {"video": "clip.mp4", "sentences": ["first half", "second half"], "timestamps": [[0, 1], [1, 2.05]]},
        {"video": "clip.mp4", "query": "late", "timestamp": [0.5, 9.0]},
        {"video": "clip.mp4", "query": "backwards", "timestamp": [1.5, 0.5]},
        {"video": "clip.mp4", "query": "another clip", "span": [0.5, 1.0], "duration": 30},
        {"video": "missing.mp4", "query": "x", "timestamps": [[0, 1]]},
    ])
    out = tmp_path / "data" / "spans.json"
    code, summary, errors = convert(capsys, src, out, "--skip-bad")
    assert code == 0 and summary["written"] == 3 and summary["spans"] == 3
    written = records(out)
    assert [r["messages"][1]["content"] for r in written] == [
        '{"span": [0.5, 1.5]}', '{"span": [0, 1]}', '{"span": [1, 2.05]}']  # 2.05: within one frame of the end
    assert written[0]["messages"][0]["content"].startswith('<video>When does "the bar grows" happen in the video?')
    assert json.loads(written[0]["meta"]) == {"id": "a1", "duration": 2.0, "query": "the bar grows"}
    assert json.loads(written[2]["meta"])["sentence_index"] == 1
    assert "span [0.5, 9] lies outside the clip (0 to 2 s" in errors[3]["error"]
    assert errors[3]["video"].endswith("clip.mp4") and "image" not in errors[3]  # a clip's row names it a video
    assert "entry 4" in errors[4]["error"] and "'backwards'" in errors[4]["error"]
    assert "declares a duration of 30 s, the clip runs 2 s" in errors[5]["error"]
    assert "missing.mp4" in errors[6]["error"] and "not found" in errors[6]["error"]
    custom = tmp_path / "data" / "custom.json"
    code, _, _ = convert(capsys, src, custom, "--skip-bad", "--prompt", "Find: {query}", "--format", "video-span")
    assert code == 0 and records(custom)[0]["messages"][0]["content"] == "<video>Find: the bar grows"
    assert main(["convert", str(src), "-o", str(tmp_path / "bad.json"), *map(str, FLAGS), "--prompt", "Find it"]) == 2
    assert "{query}" in capsys.readouterr().err


def test_track_format(tmp_path, media, capsys):
    src = write_input(media, "tracks.jsonl", [
        {"video": "clip.webm", "query": "the bar", "track": [{"time": 0.5, "bbox": [10, 8, 50, 42]},
                                                             {"time": 1.0, "bbox_2d": [20, 10, 90, 60]}]},
        {"video": "clip.webm", "query": "gone", "track": [{"time": 5.0, "bbox": [10, 8, 50, 42]}]},
        {"video": "clip.webm", "query": "nowhere", "track": []},
    ])
    out = tmp_path / "data" / "tracks.json"
    code, summary, errors = convert(capsys, src, out, "--input-coords", "abs", "--skip-bad")
    assert code == 0 and summary["written"] == 2
    frame = VideoPolicy(VIDEO_MIN, VIDEO_MAX).frame_size(*HW)
    boxes = [convert_coords(b, "orig", "model", HW, frame) for b in ([10, 8, 60, 50], [20, 10, 90, 60])]
    answer = json.loads(records(out)[0]["messages"][1]["content"])
    assert answer == [{"time": 0.5, "bbox_2d": boxes[0], "label": "the bar"},
                      {"time": 1.0, "bbox_2d": boxes[1], "label": "the bar"}]
    assert records(out)[1]["messages"][1]["content"] == "[]"
    assert "track time 5 s lies outside the clip" in errors[1]["error"]


def write_yaml(tmp_path: Path, data: Path, name: str, **extra) -> Path:
    config = {"template": "qwen2_vl", "image_min_pixels": IMAGE_MIN, "image_max_pixels": IMAGE_MAX,
              "video_min_pixels": VIDEO_MIN, "video_max_pixels": VIDEO_MAX, "qwenvl_patch": True, "dataset": name,
              "dataset_dir": str(data), "cutoff_len": 4096, **extra}
    path = tmp_path / "train.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in config.items()))
    return path


def check(capsys, yaml: Path, *args: str) -> tuple[int, dict]:
    code = main(["check", "--yaml", str(yaml), "--json", *args])
    return code, json.loads(capsys.readouterr().out)[0]


def lying_avi(path: Path, frames: int) -> Path:
    """A 2-s, 20-frame AVI whose header claims ``frames`` frames (``strh`` dwLength and ``avih`` dwTotalFrames)."""
    write_clip(path, 2, 10, 96, 64)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, data.find(b"strh") + 8 + 32, frames)
    struct.pack_into("<I", data, data.find(b"avih") + 8 + 16, frames)
    path.write_bytes(bytes(data))
    return path


def test_check_audits_videos(tmp_path, media, capsys):
    lying_avi(media / "lie.avi", 21)  # a frame more than it holds: within a cut clip's slack, so a note
    src = write_input(media, "check.jsonl", [sharegpt("clip.mp4", TRACK), sharegpt("clip.webm", '{"span": [0, 1]}'),
                                             sharegpt("lie.avi", '{"span": [1, 2]}')])
    data = tmp_path / "data"
    out = data / "vids.json"
    assert convert(capsys, src, out, "--input-coords", "abs")[0] == 0
    code, report = check(capsys, write_yaml(tmp_path, data, "vids"), "--decode")  # the sampled frames decoded too
    assert code == 0 and report["ok"] and report["videos"] == 3, report  # notes do not fail the check
    notes = {Path(n["video"]).name: n["note"] for n in report["video_notes"]}
    assert "no frame count" in notes["clip.webm"]
    assert notes["lie.avi"].startswith("its header says 21 frames, its packets 20 frames over 2 s")
    assert "clip.mp4" not in notes
    (media / "empty.mp4").write_bytes(b"")
    (media / "garbage.mp4").write_bytes(b"\x00not a video" * 64)
    lying_avi(media / "cut.avi", 40)  # twice what it holds: as an AVI cut in half reads (issue 51, class 1)
    bad = records(out)[:2] + [
        sharegpt(str(media / "empty.mp4"), '{"span": [0, 1]}'),
        sharegpt(str(media / "garbage.mp4"), '{"span": [0, 1]}'),
        sharegpt(str(media / "clip.mp4"), '{"span": [1, 4]}'),
        sharegpt(str(media / "clip.mp4"), '[{"time": 1, "bbox_2d": [0, 0, 57, 20]}]'),  # the frame is 56 wide
        sharegpt(str(media / "clip.mp4"), '[{"time": -1, "bbox_2d": [0, 0, 5, 5]}]'),
        sharegpt(str(media / "cut.avi"), '{"span": [0, 1]}'),
    ]
    out.write_text(json.dumps(bad))
    code, report = check(capsys, write_yaml(tmp_path, data, "vids", video_max_pixels=8192, cutoff_len=40))
    assert code == 1
    assert report["stamp_problems"] == [f"video max_pixels: dataset {VIDEO_MAX} vs run 8192"]
    problems = {row["sample"]: row["error"] for row in report["problems"] if "cutoff_len" not in row["error"]}
    assert "is empty (0 bytes)" in problems[2]
    assert "cannot open" in problems[3]
    assert "span [1, 4] lies outside the clip" in problems[4]
    assert "lies outside the model frame 56x28" in problems[5]
    assert "track time -1 s lies outside the clip" in problems[6]
    assert "cut.avi: is truncated or corrupt: its index lists 40 frames, 20 are there (2 s)" in problems[7]
    assert report["token_overflows"] >= 1


def test_frame_list_rate_is_stamped_and_checked(tmp_path, media, capsys):
    src = write_input(media, "fl.jsonl", [sharegpt(frame_list(), '{"span": [0, 5.5]}')])
    data = tmp_path / "data"
    yaml = write_yaml(tmp_path, data, "fl", qwenvl_frame_list_fps=1)
    code, summary, _ = convert(capsys, src, data / "fl.json", "--from-yaml", yaml, flags=["-q", "--workers", "1"])
    assert code == 0 and summary["stamp"]["video"]["frame_list_fps"] == 1.0  # 6 frames at 1 fps: a 6-s clip
    assert check(capsys, yaml)[0] == 0
    code, report = check(capsys, write_yaml(tmp_path, data, "fl", qwenvl_frame_list_fps=2))
    assert code == 1 and report["stamp_problems"][0].startswith("frame_list_fps: dataset 1 vs run 2")
    again = tmp_path / "again" / "fl.json"  # re-converting at another rate would move every label in time
    code = main(["convert", str(data / "fl.json"), "-o", str(again), *map(str, FLAGS), "--frame-list-fps", "2"])
    assert code == 2 and "--frame-list-fps 1" in capsys.readouterr().err


def test_draw_contact_sheet_and_timeline(tmp_path, media, capsys):
    src = write_input(media, "draw.jsonl", [sharegpt("clip.mp4", TRACK), sharegpt("clip.mp4", '{"span": [0.5, 1]}')])
    data = tmp_path / "data"
    out = data / "draw.json"
    assert convert(capsys, src, out, "--input-coords", "abs")[0] == 0
    predictions = tmp_path / "preds.jsonl"
    rows = [{"predict": r["messages"][1]["content"], "label": r["messages"][1]["content"]} for r in records(out)]
    rows[1]["predict"] = '{"span": [1.5, 2]}'
    predictions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for frame in ("model", "original"):
        assert main(["draw", str(out), "-o", str(tmp_path / "drawn"), "--frame", frame,
                     "--predictions", str(predictions)]) == 0
        result = json.loads(capsys.readouterr().out)
        assert len(result["images"]) == 2 and Path(result["contact_sheet"]).is_file()
        sheet = cv2.imread(result["images"][1])
        strip = sheet[-60:]
        red = (strip[:, :, 2] > 180) & (strip[:, :, 1] < 110) & (strip[:, :, 0] < 110)
        green = (strip[:, :, 1] > 160) & (strip[:, :, 2] < 120)
        assert red.any() and green.any()
        assert red.nonzero()[1].min() > green.nonzero()[1].max() - 5  # the prediction [1.5, 2] after the truth


def test_hostile_videos_are_named_error_rows(tmp_path, media, capsys):
    (media / "empty2.mp4").write_bytes(b"")
    (media / "junk.mp4").write_bytes(b"\x1a\x45\xdf\xa3 junk" * 100)
    save_image(media / "wide" / "w0.png", 20000, 16)
    save_image(media / "wide" / "w1.png", 20000, 16)
    write_clip(media / "one.mp4", 0.5, 4, 1, 1)
    span = '{"span": [0, 0.5]}'
    good = sharegpt("clip.mp4", span)
    src = write_input(media, "hostile.jsonl", [
        good,
        sharegpt("empty2.mp4", span),
        sharegpt("junk.mp4", span),
        sharegpt(["frames/f0.jpg", "frames/f1.jpg", "frames/nope.jpg"], span),
        sharegpt("clip.mp4", span, "<video><video>Two?"),
        sharegpt(["wide/w0.png", "wide/w1.png"], span),
        sharegpt("clip.mp4", '{"span": [0.2, 2.3]}'),
        sharegpt("clip.mp4", '{"span": [0.5, "end"]}'),
    ])
    out = tmp_path / "data" / "hostile.json"
    code, summary, errors = convert(capsys, src, out)
    assert code == 1 and not out.exists() and not (out.parent / "dataset_info.json").exists()  # nothing half-written
    assert sorted(errors) == [1, 2, 3, 4, 5, 6, 7], errors
    assert "empty2.mp4: is empty (0 bytes)" in errors[1]["error"]
    assert "junk.mp4: cannot open" in errors[2]["error"]
    assert "frame 2" in errors[3]["error"] and "nope.jpg" in errors[3]["error"]
    assert "1 video(s) but 2 <video> tag(s)" in errors[4]["error"]
    assert "aspect ratio" in errors[5]["error"]
    assert "span [0.2, 2.3] lies outside the clip" in errors[6]["error"]
    assert "span [0.5, 'end'] must be [start, end]" in errors[7]["error"]
    code, summary, _ = convert(capsys, src, out, "--skip-bad")
    assert code == 0 and summary["written"] == 1 and summary["dropped"] == 7
    # a 1x1 clip is sized like a 1x1 image (upscaled to one patch), not refused: the policy is the images'
    one = write_input(media, "one.jsonl", [sharegpt("one.mp4", '[{"time": 0, "bbox_2d": [0, 0, 1, 1]}]')])
    code, _, _ = convert(capsys, one, tmp_path / "data" / "one.json", "--input-coords", "abs")
    assert code == 0 and VideoPolicy(VIDEO_MIN, VIDEO_MAX).frame_size(1, 1) == (28, 28)
    assert json.loads(records(tmp_path / "data" / "one.json")[0]["messages"][1]["content"])[0]["bbox_2d"] == [
        0, 0, 28, 28]


def test_mixing_files_and_frame_lists_is_refused_by_record(tmp_path, media, capsys):
    src = write_input(media, "mixed-kinds.jsonl", [
        sharegpt("clip.mp4", '{"span": [0, 1]}'), sharegpt(frame_list(), '{"span": [0, 1]}'),
        {"messages": [{"role": "user", "content": "<video><video>Both?"}, {"role": "assistant", "content": "no"}],
         "videos": ["clip.mp4", frame_list()]},
        {"messages": [{"role": "user", "content": "<image><video>Same?"}, {"role": "assistant", "content": "no"}],
         "images": ["frames/f0.jpg"], "videos": [frame_list()]}])
    code, _, errors = convert(capsys, src, tmp_path / "data" / "m.json", "--skip-bad")
    assert code == 0 and sorted(errors) == [1, 2, 3]
    assert "frame lists, record 0's are video files" in errors[1]["error"]
    assert "mixes video files and frame lists" in errors[2]["error"]
    # a record with an image and a video of the other kind: its row names the video, not the image
    assert "frame lists, record 0's are video files" in errors[3]["error"] and "image" not in errors[3], errors[3]
    assert errors[3]["video"] == errors[1]["video"] and "f0.jpg" in errors[3]["video"], errors[3]


def test_a_clip_of_100k_frames_is_probed_in_bounded_memory(tmp_path, capsys):
    """Packets only, never pixels: 10^5 frames are probed in seconds, holding one time per frame."""
    import av
    import numpy as np

    path = tmp_path / "long.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=1000)
        stream.width = stream.height = 16
        stream.pix_fmt, stream.codec_context.gop_size = "yuv420p", 100_000
        pixels = np.zeros((16, 16, 3), np.uint8)
        for i in range(100_000):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    tracemalloc.start()
    try:
        clip = probe(path, 2.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(clip.times) == 100_000 and clip.duration == pytest.approx(100.0)
    assert peak < 32 * 2**20, peak
    src = write_input(tmp_path, "long.jsonl", [sharegpt("long.mp4", '{"span": [50, 99.9]}')])
    code, summary, _ = convert(capsys, src, tmp_path / "data" / "long.json")
    assert code == 0 and summary["spans"] == 1


def test_a_stamped_video_dataset_is_retargeted_through_the_clip(tmp_path, media, capsys):
    src = write_input(media, "restamp.jsonl", [sharegpt("clip.mp4", TRACK)])
    first = tmp_path / "a" / "train.json"
    assert convert(capsys, src, first, "--input-coords", "abs")[0] == 0
    same = tmp_path / "b" / "train.json"
    assert convert(capsys, first, same)[0] == 0
    assert records(same) == records(first)  # the same policy: identical
    bigger = tmp_path / "c" / "train.json"
    flags = [v if v != VIDEO_MAX else 2 * VIDEO_MAX for v in FLAGS]
    code, summary, _ = convert(capsys, first, bigger, flags=flags)
    assert code == 0 and summary["stamp"]["video"]["max_pixels"] == 2 * VIDEO_MAX
    old, new = VideoPolicy(VIDEO_MIN, VIDEO_MAX).frame_size(*HW), VideoPolicy(VIDEO_MIN, 2 * VIDEO_MAX).frame_size(*HW)
    assert old != new
    before = [b["bbox_2d"] for b in json.loads(records(first)[0]["messages"][1]["content"])]
    after = [b["bbox_2d"] for b in json.loads(records(bigger)[0]["messages"][1]["content"])]
    assert after == [retarget_coords(box, "model", old, "model", new, HW) for box in before]


def test_check_counts_each_qwen3_group_with_its_stamp(tiny_model_qwen3, media):
    """Qwen3's video tokens are, per group, its ``<t seconds>`` stamp, vision start, its frame tokens and vision end
    (what the pinned plugin writes): check counted only the frame tokens and one start/end pair (~9 tokens a group
    short). Its count equals the tokenizer's count of the plugin's structure."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer

    from qwenvl_prep.pipeline.check_video import VideoChecker

    tokenizer = Tokenizer.from_file(str(tiny_model_qwen3 / "tokenizer.json"))
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731
    family = FAMILIES["qwen3_vl"]
    video = VideoPolicy(256, 64 * 32 * 32, family.factor, 2.0, 128, family.video_clock)
    run = Stamp(ResizePolicy(256, 64 * 32 * 32, family.factor), family.coords, family.name, video=video)
    clip = str(media / "clip.mp4")
    tokens, problems = VideoChecker(run, run, count_text=count).scan(
        SimpleNamespace(videos=[clip, clip], index=0))
    plan = probe(clip, 2.0).plan(video)
    pads = video.frame_tokens(64, 96)
    structure = "".join(f"{stamp}<|vision_start|>{'<|video_pad|>' * pads}<|vision_end|>" for stamp in plan.stamp_texts)
    assert problems == [] and plan.groups > 1
    assert tokens == 2 * count(structure) > 2 * (plan.groups * pads + 2)
