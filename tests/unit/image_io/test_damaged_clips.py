"""Issue 51, classes 1 and 3, in the clip probe every reader shares: a clip cut short that still opens is named
truncated (not taken as a shorter, whole clip), a clip with no frames is named as such, and a phone clip's display
rotation is read (training reads the stored frames)."""

from __future__ import annotations

import av
import numpy as np
import pytest
from helpers import cut_file, set_display_rotation, write_clip

from llamafactory_qwenvl_patch.image_io.video import VideoFileError, display_rotation, probe

FASTSTART = {"movflags": "faststart"}


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
    assert display_rotation(plain) == 0
    assert display_rotation(turned) == degrees
    clip = probe(turned, 2.0)
    assert (clip.width, clip.height, len(clip.times)) == (96, 64, 10)


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
        display_rotation(path)
