"""The temporal grounding datasets as distributed (issue 49, item 4): Charades-STA's txt, ActivityNet Captions' JSON
object and QVHighlights' JSONL, each detected from its content, its video ids found as clips in --video-dir, its
times written as the file writes them, its declared durations checked against the clip, every bad line an error row
naming where it is; the output passes ``qwenvl-prep check``."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest
from helpers import write_clip

from llamafactory_qwenvl_patch.scoring.temporal import parse_spans, span_score
from qwenvl_prep.cli import main
from qwenvl_prep.formats import json_array
from qwenvl_prep.formats.records import RecordError, detect_format
from qwenvl_prep.formats.temporal_datasets import CLIP_NAMES, PROMPTS, ClipFolder

FLAGS = ["--min-pixels", "3136", "--max-pixels", "200704", "--video-min-pixels", "256", "--video-max-pixels", "4096",
         "-q", "--workers", "1"]
SPAN_PROMPT = ('When does "{}" happen in the video? Output its start and end in seconds as JSON: '
               '{{"span": [start, end]}}.')
QVH = "NUyK5oHvqUA_210.0_360.0"


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """Three tiny clips named as the datasets name them: a 3-s Charades mp4, a 2-s ActivityNet webm stored without
    its id's ``v_``, a 4-s QVHighlights mp4."""
    folder = tmp_path_factory.mktemp("clips")
    write_clip(folder / "3MSZA.mp4", 3, 10, 96, 64)
    write_clip(folder / "QOlSCBRmfWY.webm", 2, 10, 96, 64, "libvpx")
    write_clip(folder / f"{QVH}.mp4", 4, 10, 96, 64)
    return folder


def convert(capsys, src: Path, out: Path, *args) -> tuple[int, dict, list[str]]:
    """(exit code, summary, error messages in order) of one convert run."""
    code = main(["convert", str(src), "-o", str(out), *FLAGS, *map(str, args)])
    summary = json.loads(capsys.readouterr().out)
    report = summary.get("error_report")
    errors = [json.loads(line)["error"] for line in Path(report).read_text().splitlines()] if report else []
    return code, summary, errors


def written(out: Path) -> list[dict]:
    return json.loads(out.read_text())


def answers(out: Path) -> list[str]:
    return [record["messages"][1]["content"] for record in written(out)]


def check(capsys, out: Path) -> tuple[int, dict]:
    """``qwenvl-prep check`` of a converted dataset against a YAML of the same bounds."""
    yaml = out.parent / f"{out.stem}.yaml"
    yaml.write_text(f"template: qwen2_vl\nimage_min_pixels: 3136\nimage_max_pixels: 200704\nvideo_min_pixels: 256\n"
                    f"video_max_pixels: 4096\nqwenvl_patch: true\ndataset: {out.stem}\ndataset_dir: {out.parent}\n"
                    "cutoff_len: 4096\n")
    code = main(["check", "--yaml", str(yaml), "--json"])
    return code, json.loads(capsys.readouterr().out)[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_charades_sta_lines(tmp_path, clips, capsys):
    src = tmp_path / "charades_sta_train.txt"
    src.write_bytes(b"3MSZA 0.50 2.0##person turn a light on.\r\n"
                    b"\n"
                    b"3MSZA 1 3##person opens a door\n"
                    b"MISSING 1.0 2.0##person sits down.\n"
                    b"3MSZA 2.0##person laughs.\n"
                    b"3MSZA 4.0 9.0##person runs away.\n"
                    b"3MSZA 1.O 2.0##person eats.\n"
                    b"3MSZA 2.5 1.5##person drinks.\n"
                    b"3MSZA 1.5 3.40##person leaves.\n")
    before = digest(src)
    assert detect_format(src) == "charades-sta"
    out = tmp_path / "data" / "charades.json"
    code, summary, errors = convert(capsys, src, out, "--video-dir", clips)
    assert code == 1 and summary["output"] is None and not out.exists()  # nothing written unless every line converts
    assert errors == [
        f"line 4, video MISSING: no clip in {clips} (tried MISSING.mp4); give --video-dir, the folder that holds the "
        "dataset's clips",
        "line 5: expected 'VID START END##sentence', got '3MSZA 2.0##person laughs.'",
        f"line 6, video 3MSZA: video {clips / '3MSZA.mp4'}: span [4, 9] lies outside the clip (0 to 3 s, one frame of "
        "0.1 s allowed past its end)",  # it starts past the clip's end: nothing of it to keep
        "line 7, video 3MSZA: the start time '1.O' is not a number of seconds as JSON writes one (e.g. 24.3)",
        "line 8, video 3MSZA: the window [2.5, 1.5] lies outside the clip (need 0 <= start < end, in seconds)",
    ]
    rows = [json.loads(line) for line in Path(summary["error_report"]).read_text().splitlines()]
    assert all("video" in row and "image" not in row for row in rows)  # a missing clip's row too: a video dataset
    code, summary, _ = convert(capsys, src, out, "--video-dir", clips, "--skip-bad")
    assert code == 0 and summary["written"] == 3 and summary["spans"] == 3 and summary["dropped"] == 5
    # the times as the file writes them; an end past the clip's (Charades-STA's ends come from annotations that run
    # past their videos) set to the clip's end, counted and noted in meta
    assert answers(out) == ['{"span": [0.50, 2.0]}', '{"span": [1, 3]}', '{"span": [1.5, 3]}']
    assert summary["spans_clamped"] == 1
    assert json.loads(written(out)[2]["meta"])["span_ends_clamped_from"] == ["3.40"]
    assert "span_ends_clamped_from" not in written(out)[0]["meta"]
    first = written(out)[0]
    assert first["messages"][0]["content"] == "<video>" + SPAN_PROMPT.format("person turn a light on.")
    assert first["videos"] == [str(clips / "3MSZA.mp4")]
    assert json.loads(first["meta"]) == {"vid": "3MSZA", "query": "person turn a light on.", "line": 1,
                                         "source_format": "charades-sta", "duration": 3.0}  # the clip's, from packets
    assert json.loads(written(out)[1]["meta"])["line"] == 3
    assert digest(src) == before  # the user's file is read, never written
    code, report = check(capsys, out)
    assert code == 0 and report["ok"] and report["videos"] == 3, report


def test_activitynet_captions_object(tmp_path, clips, capsys):
    videos = {
        "v_QOlSCBRmfWY": {"duration": 2.0, "timestamps": [[0.0, 1.0], [0.5, 1.999], [1.5, 0.5]],
                          "sentences": [" A woman rides a bike.", " Then she stops. ", "She waves."]},
        "v_nope": {"duration": 10.0, "timestamps": [[0, 1], [1, 2]], "sentences": ["one", "two"]},
        "v_3MSZA": {"duration": 60.0, "timestamps": [[0, 1]], "sentences": ["a clip of another length"]},
        "v_uneven": {"duration": 2.0, "timestamps": [[0, 1]], "sentences": ["one", "two"]},
    }
    text = json.dumps(videos, indent=2).replace("1.999", "2.00")  # a time as no Python float writes it
    text = text.replace('"v_uneven"', '"v_QOlSCBRmfWY": {}, "v_uneven"', 1)  # an id twice
    src = tmp_path / "train.json"
    src.write_text(text)
    assert detect_format(src) == "activitynet-captions"
    out = tmp_path / "data" / "anet.json"
    code, summary, errors = convert(capsys, src, out, "--video-dir", clips, "--skip-bad")
    assert code == 0 and summary["records"] == 7 and summary["written"] == 2
    # the id without its v_ and the .webm found; the windows as written, one record per sentence
    assert answers(out) == ['{"span": [0.0, 1.0]}', '{"span": [0.5, 2.00]}']
    assert [r["messages"][0]["content"] for r in written(out)] == [
        "<video>" + SPAN_PROMPT.format("A woman rides a bike."), "<video>" + SPAN_PROMPT.format("Then she stops.")]
    assert {tuple(r["videos"]) for r in written(out)} == {(str(clips / "QOlSCBRmfWY.webm"),)}
    assert json.loads(written(out)[1]["meta"]) == {"vid": "v_QOlSCBRmfWY", "query": "Then she stops.",
                                                   "sentence_index": 1, "source_format": "activitynet-captions",
                                                   "duration": 2.0}
    assert errors == [
        "entry 1, video v_QOlSCBRmfWY, sentence 2: the window [1.5, 0.5] lies outside the clip (need 0 <= start < "
        "end, in seconds)",
        f"entry 2, video v_nope: no clip in {clips} (tried v_nope.mp4, v_nope.mkv, v_nope.webm, nope.mp4, nope.mkv, "
        "nope.webm); give --video-dir, the folder that holds the dataset's clips",  # one row for its two sentences
        f"entry 3, video v_3MSZA, sentence 0: video {clips / '3MSZA.mp4'}: the record declares a duration of 60 s, "
        "the clip runs 3 s (another or a cut video?); its times would not match",
        "entry 4, video v_QOlSCBRmfWY: the id appears again (first in entry 1); a JSON reader would keep only one of "
        "them",
        "entry 5, video v_uneven: needs 'sentences' and 'timestamps': two lists of the same length, one [start, end] "
        "window per sentence, got 2 items and 1 items",
    ]
    code, report = check(capsys, out)
    assert code == 0 and report["ok"], report

    cut = tmp_path / "val_1.json"  # a file cut off after its first video: that video's records, then one error row
    cut.write_text(json.dumps({"v_QOlSCBRmfWY": videos["v_QOlSCBRmfWY"], "v_nope": videos["v_nope"]})[:-40])
    code, summary, errors = convert(capsys, cut, tmp_path / "data" / "cut.json", "--video-dir", clips, "--skip-bad",
                                    "--format", "activitynet-captions")
    assert code == 0 and summary["written"] == 2
    assert errors[-1].startswith(f"{cut} is not a valid JSON object from here on (byte ")


def test_qvhighlights_keeps_every_window(tmp_path, clips, capsys):
    lines = [
        {"qid": 8737, "query": "A man talks to the camera.", "duration": 4, "vid": QVH,
         "relevant_windows": [[0, 2], [2.5, 4]], "relevant_clip_ids": [0, 1], "saliency_scores": [[4, 4, 2]]},
        {"qid": 8738, "query": "A dog runs.", "duration": 150, "vid": QVH, "relevant_windows": [[0, 2]]},
        {"qid": 8739, "query": "The test split has no windows.", "duration": 4, "vid": QVH},
        {"qid": 8740, "query": "Too late.", "duration": 4, "vid": QVH, "relevant_windows": [[0, 1], [3, 9]]},
        {"qid": 8741, "query": "Backwards.", "duration": 4, "vid": QVH, "relevant_windows": [[0, 1], [3, 2]]},
        {"qid": 8742, "query": "Elsewhere.", "duration": 4, "vid": "gone_0.0_150.0", "relevant_windows": [[0, 1]]},
    ]
    src = tmp_path / "highlight_val_release.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"qid": 8743, "query": \n')
    assert detect_format(src) == "qvhighlights"
    out = tmp_path / "data" / "qvh.json"
    code, summary, errors = convert(capsys, src, out, "--video-dir", clips, "--skip-bad")
    assert code == 0 and summary["written"] == 2 and summary["spans"] == 4 and summary["spans_clamped"] == 1
    assert answers(out) == ['[{"span": [0, 2]}, {"span": [2.5, 4]}]', '[{"span": [0, 1]}, {"span": [3, 4]}]']
    record = written(out)[0]
    assert record["messages"][0]["content"] == "<video>" + PROMPTS["qvhighlights"].replace(
        "{query}", "A man talks to the camera.")
    assert json.loads(record["meta"]) == {"qid": 8737, "query": "A man talks to the camera.", "vid": QVH, "line": 1,
                                          "source_format": "qvhighlights", "duration": 4.0}
    # the reward reads both windows and matches them one to one: the answer itself scores 1, one window of two 0.5
    truth = parse_spans(answers(out)[0])
    assert truth == [(0, 2), (2.5, 4)]
    assert span_score(truth, truth) == 1.0 and span_score(truth, [(0, 2)]) == 0.5
    video = clips / f"{QVH}.mp4"
    assert errors == [
        f"line 2, video {QVH}, qid 8738: video {video}: the record declares a duration of 150 s, the clip runs 4 s "
        "(another or a cut video?); its times would not match",
        f"line 3, video {QVH}, qid 8739: has no 'relevant_windows' (QVHighlights' test split does not publish them): "
        "nothing to train or score",
        f"line 5, video {QVH}, qid 8741: window 1: the window [3, 2] lies outside the clip (need 0 <= start < end, "
        "in seconds)",
        f"line 6, video gone_0.0_150.0, qid 8742: no clip in {clips} (tried gone_0.0_150.0.mp4); give --video-dir, "
        "the folder that holds the dataset's clips",
        "line 7: not valid JSON (Expecting value: line 1 column 23 (char 22))",
    ]
    code, report = check(capsys, out)
    assert code == 0 and report["ok"], report


def test_lines_that_are_not_records_are_their_own_rows(tmp_path, clips, capsys):
    src = tmp_path / "highlight_train_release.jsonl"
    good = {"qid": 1, "query": "A man talks.", "duration": 4, "vid": QVH, "relevant_windows": [[0, 2]]}
    src.write_bytes(json.dumps(good).encode() + b"\n\xff\xfe not text\n[1, 2]\n" + json.dumps(good).encode())
    code, summary, errors = convert(capsys, src, tmp_path / "data" / "q.json", "--video-dir", clips, "--skip-bad")
    assert code == 0 and summary["written"] == 2
    assert errors == ["line 2: not valid UTF-8 (byte 0)", "line 3: a QVHighlights line is a JSON object"]
    charades = tmp_path / "charades_sta_test.txt"
    charades.write_bytes(b"3MSZA 0.0 1.5##person \xe9ats.\n3MSZA 0.0 1.5##  \n3MSZA 0 1##<video> twice\n"
                         b"3MSZA 0 1##person sits.\n")
    code, summary, errors = convert(capsys, charades, tmp_path / "data" / "c.json", "--video-dir", clips,
                                    "--skip-bad", "--format", "charades-sta")
    assert code == 0 and summary["written"] == 1 and errors == [
        "line 1: not valid UTF-8 (byte 22)", "line 2, video 3MSZA: the query must be non-empty text, got ''",
        "line 3, video 3MSZA: the query '<video> twice' contains <video>, which LLaMA-Factory would read as another "
        "media item"]


def test_video_dir_and_its_image_dir_alias(tmp_path, clips, capsys):
    src = tmp_path / "charades_sta_test.txt"
    src.write_text("3MSZA 0.0 1.5##person turn a light on.\n")
    by_video_dir, by_image_dir = tmp_path / "data" / "a.json", tmp_path / "data" / "b.json"
    assert convert(capsys, src, by_video_dir, "--video-dir", clips, "--format", "charades-sta")[0] == 0
    assert convert(capsys, src, by_image_dir, "--image-dir", clips)[0] == 0
    assert written(by_video_dir) == written(by_image_dir)
    assert main(["convert", str(src), "-o", str(tmp_path / "data" / "c.json"), *FLAGS, "--video-dir",
                 str(tmp_path / "nowhere")]) == 2
    assert f"the video folder {tmp_path / 'nowhere'} (--video-dir) is not a folder" in capsys.readouterr().err
    # the clips lie next to the file by default: the input's folder
    shutil.copy(clips / "3MSZA.mp4", tmp_path / "3MSZA.mp4")
    assert convert(capsys, src, tmp_path / "data" / "d.json")[0] == 0
    # --format is obeyed: read as video-span, its lines are no JSON records
    assert main(["convert", str(src), "-o", str(tmp_path / "data" / "e.json"), *FLAGS, "--format", "video-span"]) == 1


def test_clip_names_are_tried_in_order(tmp_path):
    """ActivityNet: the id as written, then without its v_ (or with it, when written without), each as .mp4, .mkv,
    .webm; the first file present wins. Charades-STA and QVHighlights: the id's .mp4."""
    names = CLIP_NAMES["activitynet-captions"]
    assert names.candidates("v_abc") == ["v_abc.mp4", "v_abc.mkv", "v_abc.webm", "abc.mp4", "abc.mkv", "abc.webm"]
    assert names.candidates("abc")[3:] == ["v_abc.mp4", "v_abc.mkv", "v_abc.webm"]
    assert CLIP_NAMES["charades-sta"].candidates("3MSZA") == ["3MSZA.mp4"]
    for name in ("abc.mp4", "v_abc.webm", "v_abc.mkv"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "v_abc.mp4").mkdir()  # a folder is no clip
    assert ClipFolder(tmp_path).find("v_abc", names) == "v_abc.mkv"
    assert ClipFolder(tmp_path).find("abc", names) == "abc.mp4"
    with pytest.raises(RecordError, match=r"tried ../x.mp4\)"):
        ClipFolder(tmp_path).find("../x", CLIP_NAMES["qvhighlights"])  # ids are names in the folder, never paths


def test_object_members_are_streamed_as_written():
    text = b' {"v_a": {"duration": 1.50, "x": [1, {"y": "}"}]}, "v_b" : 7 ,"c":"s"} '
    original = json_array.CHUNK
    json_array.CHUNK = 5  # members that run past the read window
    try:
        assert list(json_array.iter_object_members(io.BytesIO(text))) == [
            ("v_a", b'{"duration": 1.50, "x": [1, {"y": "}"}]}'), ("v_b", b"7"), ("c", b'"s"')]
        for broken, where in ((b'{"a": 1 "b": 2}', "expected ',' or '}' after a member"),
                              (b'{"a": 1} x', "text after the object's closing '}'"), (b"[1]", "expected '{'")):
            with pytest.raises(json_array.ArraySyntaxError, match=where):
                list(json_array.iter_object_members(io.BytesIO(broken)))
    finally:
        json_array.CHUNK = original


def test_span_ends_past_the_clip_are_set_to_its_end_as_written():
    """The clamp rewrites only the ends past the clip, with the clip's end floored to the millisecond (never past
    it); every other number stays as written, and a span that starts past the end is left for the check to refuse."""
    from qwenvl_prep.pipeline.convert_video import clamp_span_ends

    assert clamp_span_ends('{"span": [1.50, 3.40]}', 2.9876) == ('{"span": [1.50, 2.987]}', ["3.40"])
    assert clamp_span_ends('[{"span": [0, 1.0]}, {"span": [2, 1e1]}]', 4.0) == (
        '[{"span": [0, 1.0]}, {"span": [2, 4]}]', ["1e1"])
    assert clamp_span_ends('{"span": [0.0, 2.9876]}', 2.9876) == ('{"span": [0.0, 2.9876]}', [])
    assert clamp_span_ends('{"span": [5, 9]}', 4.0) == ('{"span": [5, 9]}', [])
