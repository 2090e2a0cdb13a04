"""Issue 51, classes 1 and 3, in the clip probe every reader shares: a clip cut short that still opens is named
truncated (not taken as a shorter, whole clip), a clip with no frames is named as such, and a phone clip's display
rotation is read (training reads the stored frames). A clip cut anywhere, its index too, is whole or named: never
another exception."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
import pytest
from helpers import cut_file, set_display_matrix, set_display_rotation, write_clip

from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.image_io.video import DisplayMatrix, VideoFileError, display_matrix, probe, read_clip

FASTSTART = {"movflags": "faststart"}
EVERY_FRAME = VideoPolicy(256, 4096, 28, 10.0, 128)  # a 10-fps clip's every frame sampled, up to 12.8 s


@pytest.mark.parametrize("name,codec,options", [("clip.mp4", "mpeg4", FASTSTART), ("clip.webm", "libvpx", None)])
def test_a_clip_cut_in_half_is_named_truncated(tmp_path, name, codec, options):
    """A faststart mp4 keeps its sample table (20 frames) and a webm its header's 2 s when cut; their packets stop
    early. Today's probe returned a shorter clip (a duration under 1 s) that convert and training took as whole."""
    whole = write_clip(tmp_path / name, 2, 10, 96, 64, codec, options)
    assert probe(whole, 2.0).duration == pytest.approx(2.0)
    cut = cut_file(whole, tmp_path / f"cut_{name}")
    with av.open(str(cut)) as container:  # it still opens
        assert container.streams.video
    stated = "20 frames over 2 s" if name.endswith(".mp4") else "2 s"
    with pytest.raises(VideoFileError, match=rf"cut_{name}: is truncated or corrupt: its header states {stated}, "
                                             r"but its packets stop after \d+ frames"):
        probe(cut, 2.0)


def test_a_cut_that_leaves_no_frame_data_is_named_truncated(tmp_path):
    whole = write_clip(tmp_path / "clip.mp4", 2, 10, 96, 64, options=FASTSTART)
    data = whole.read_bytes()
    (tmp_path / "header_only.mp4").write_bytes(data[:data.index(b"mdat") - 4])  # the index, none of the frames
    with pytest.raises(VideoFileError, match="header_only.mp4: is truncated or corrupt: its header states 20 frames "
                                             "over 2 s, but the file holds no frame data"):
        probe(tmp_path / "header_only.mp4", 2.0)



def index_cut(data: bytes) -> int:
    """A cut inside the file's index: an mp4's sample description (at its end unless faststart: PyAV then gives the
    stream no codec context, and today's probe raised AttributeError), an AVI's ``idx1`` (every frame is there)."""
    return data.index(b"stsd" if b"stsd" in data else b"idx1") + 8


@pytest.mark.parametrize("name,seconds,options", [("clip.mp4", 2, FASTSTART), ("clip.mp4", 2, None),
                                                  ("clip.mov", 2, FASTSTART), ("clip.avi", 10, None)],
                         ids=["mp4-faststart", "mp4", "mov", "avi"])
def test_a_clip_cut_anywhere_is_whole_or_named(tmp_path, name, seconds, options):
    """Every 20th of the file and inside its index: a cut either opens as the whole clip, every frame there and
    decoding, or is a VideoFileError naming the file. Today a cut mp4 or mov index raised AttributeError (convert,
    check and the training pre-flight stopped with a traceback), and an AVI cut at 80% was a shorter, whole clip (its
    header's 100 frames were never compared with the 85 there)."""
    whole = write_clip(tmp_path / name, seconds, 10, 96, 64, "mpeg4", options)
    frames = len(probe(whole, 2.0).times)
    data = whole.read_bytes()
    cut = tmp_path / f"cut_{name}"
    for size in sorted({len(data) * k // 20 for k in range(1, 20)} | {index_cut(data)}):
        cut.write_bytes(data[:size])
        try:
            clip = probe(cut, 2.0)
            display_matrix(cut)
            read_clip(cut, EVERY_FRAME, 2.0, clip=clip)
        except VideoFileError as exc:
            assert f"video {cut}: " in str(exc), (size, exc)
            continue
        assert len(clip.times) == frames, (size, len(clip.times))



def test_a_clip_cut_inside_its_last_frame_is_named(tmp_path):
    """Its packets reach the stated end within the slack, but the demuxer reads the last one short (today: a whole
    clip whose last frame decodes from part of its data)."""
    data = write_clip(tmp_path / "clip.mp4", 2, 10, 96, 64, options=FASTSTART).read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[:-10])  # a faststart mp4 ends with its last frame's data
    with pytest.raises(VideoFileError, match="cut.mp4: is truncated or corrupt: its packet 20 of 20 is cut short"):
        probe(tmp_path / "cut.mp4", 2.0)

def test_an_avi_cut_is_measured_by_its_frame_count(tmp_path):
    """An AVI states its length as a frame count; once its index (at the file's end) is cut off, ffmpeg's duration
    is a guess from the file's size, so a cut AVI's stated seconds shrink with it: only the count tells."""
    data = write_clip(tmp_path / "clip.avi", 10, 10, 96, 64).read_bytes()
    (tmp_path / "cut.avi").write_bytes(data[:len(data) * 8 // 10])
    with pytest.raises(VideoFileError, match=r"cut.avi: is truncated or corrupt: its index lists 100 frames, \d+ are "
                                             r"there \([\d.]+ s\); labels made on the whole clip"):
        probe(tmp_path / "cut.avi", 2.0)
    (tmp_path / "no_index.avi").write_bytes(data[:index_cut(data)])
    assert len(probe(tmp_path / "no_index.avi", 2.0).times) == 100


def test_an_mp4_trimmed_by_its_edit_list_is_whole(tmp_path):
    """Why an mp4's sample table is not compared with its packets: an edit list that trims the clip's start keeps
    the hidden frames in the table (here 20, 5 hidden) and states the trimmed seconds; ffmpeg reads the 15 shown."""
    path = tmp_path / "trimmed.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for index in range(20):
            frame = av.VideoFrame.from_ndarray(np.full((64, 96, 3), index * 10, np.uint8), format="rgb24")
            frame.pts, frame.time_base = index - 5, Fraction(1, 10)  # the first 5 before the clip's start
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 20
    clip = probe(path, 2.0)
    assert (len(clip.times), clip.duration) == (15, pytest.approx(1.5))

def test_clips_with_no_frames_say_so(tmp_path):
    """A stream that got no frame: ffmpeg's mp4 muxer then writes no track at all (today: "has no video stream"),
    and a fragmented mp4's init segment has a video track with no samples."""
    with av.open(str(tmp_path / "none.mp4"), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        container.start_encoding()
    with pytest.raises(VideoFileError, match="none.mp4: has no frames"):
        probe(tmp_path / "none.mp4", 2.0)
    fragmented = write_clip(tmp_path / "frag.mp4", 2, 10, 96, 64, options={"movflags": "frag_keyframe+empty_moov"})
    data = fragmented.read_bytes()
    (tmp_path / "init.mp4").write_bytes(data[:data.index(b"moof") - 4])
    with pytest.raises(VideoFileError, match="init.mp4: its video stream has no frames"):
        probe(tmp_path / "init.mp4", 2.0)


@pytest.mark.parametrize("degrees", [90, 180, 270])
def test_a_phone_clips_display_rotation_is_read(tmp_path, degrees):
    """The display matrix PyAV 16 gives on decoded frames (``frame.rotation``, counter-clockwise), as the degrees
    a player turns the stored frames clockwise; the packets and the stored size are the clip's."""
    plain = write_clip(tmp_path / "plain.mp4", 1, 10, 96, 64)
    turned = set_display_rotation(write_clip(tmp_path / "turned.mp4", 1, 10, 96, 64), degrees)
    assert display_matrix(plain) == DisplayMatrix(0, False)
    assert display_matrix(turned) == DisplayMatrix(degrees, False)
    clip = probe(turned, 2.0)
    assert (clip.width, clip.height, len(clip.times)) == (96, 64, 10)


@pytest.mark.parametrize("matrix", [(-1, 0, 0, 1), (1, 0, 0, -1), (0, 1, 1, 0)], ids=["left-right", "upside", "diag"])
def test_a_mirrored_display_matrix_is_read_as_a_mirror(tmp_path, matrix):
    """Issue 51, class 3: a matrix that flips (negative determinant) was read by its turn alone: a left-right mirror
    as 180 degrees (a copy baked turned would put labels 48 px off), an upside-down one as no change at all."""
    clip = set_display_matrix(write_clip(tmp_path / "flipped.mp4", 1, 10, 96, 64), *matrix)
    assert display_matrix(clip).mirrored and display_matrix(clip).in_words() == "mirror it"


def test_a_clip_whose_first_frame_is_garbage_is_named_when_its_rotation_is_read(tmp_path):
    """The packets are intact (the probe passes), the frame data is not: reading the rotation decodes the first
    frame, so the clip is named corrupt before training decodes it."""
    path = write_clip(tmp_path / "garbage.mp4", 1, 10, 96, 64)
    with av.open(str(path)) as container:
        first = next(p for p in container.demux(container.streams.video[0]) if p.size)
        start, size = first.pos, first.size
    data = bytearray(path.read_bytes())
    data[start + 4:start + size] = np.random.default_rng(0).integers(0, 256, size - 4, np.uint8).tobytes()
    path.write_bytes(bytes(data))
    assert len(probe(path, 2.0).times) == 10
    with pytest.raises(VideoFileError, match="garbage.mp4: its first frame does not decode"):
        display_matrix(path)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_a_still_image_named_as_a_clip_is_named(tmp_path, fmt):
    """Issue 51, class 1: a PNG saved as ``.mp4`` probed as a 0-s clip of one frame and passed the pre-flight."""
    from PIL import Image

    path = tmp_path / "still.mp4"
    Image.new("RGB", (64, 48), (20, 40, 60)).save(path, fmt)
    with pytest.raises(VideoFileError, match=f"still.mp4: is a still image \\({fmt.lower()}\\), not a video"):
        probe(path, 2.0)
