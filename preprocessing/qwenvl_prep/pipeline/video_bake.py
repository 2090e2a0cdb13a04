"""An upright copy of a clip stored rotated (``convert --video-rotation bake``): a phone clip's display matrix tells
players to turn its frames, which training does not (it reads the stored frames), so the copy holds the frames as
displayed. Every frame keeps its presentation time, checked on the written copy, so time labels stay true.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from llamafactory_qwenvl_patch.image_io.video import VideoFileError, probe

CRF = "17"  # x264's visually lossless quality: the copy is re-encoded once
TIME_TOLERANCE_S = 1e-3  # a frame time of the copy this close to the source's is the same time


def bake_rotation(path: str, degrees: int, out_dir: str | os.PathLike) -> str:
    """The path of a copy of the clip at ``path`` with its frames turned ``degrees`` clockwise (a multiple of 90),
    written under ``out_dir`` (temp file, then rename) with no audio and no display matrix. The name is a hash of the
    source's path, size and modification time, so repeated runs and parallel workers reuse one copy."""
    import av

    if degrees % 90:
        raise VideoFileError(f"video {path}: its display matrix turns it {degrees} degrees, not a multiple of 90; "
                             "rotate the clip yourself, or keep it as stored with --video-rotation raw")
    source = Path(path)
    stat = source.stat()
    key = f"{source.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{degrees}".encode()
    out = Path(out_dir) / f"{hashlib.sha1(key).hexdigest()[:16]}.mp4"
    if out.exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".bake-", suffix=".mp4")
    os.close(fd)
    try:
        _write_turned(str(source), tmp, degrees // 90)
        _check_times(str(source), tmp)
        os.replace(tmp, out)
    except (av.FFmpegError, OSError, ValueError) as exc:
        if isinstance(exc, VideoFileError):
            raise
        raise VideoFileError(f"video {path}: cannot write an upright copy ({exc})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(out)


def _write_turned(source: str, target: str, turns: int) -> None:
    """Decode every frame, turn it ``turns`` x 90 degrees clockwise, encode it at its own presentation time."""
    import av
    import numpy as np

    with av.open(source) as reader, av.open(target, "w", format="mp4") as writer:
        stream = reader.streams.video[0]
        encoder = None
        for frame in reader.decode(stream):
            pixels = np.ascontiguousarray(np.rot90(frame.to_ndarray(format="rgb24"), k=-turns))
            if encoder is None:
                encoder = _encoder(writer, stream, pixels.shape[1], pixels.shape[0])
            turned = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            turned.pts, turned.time_base = frame.pts, stream.time_base
            writer.mux(encoder.encode(turned))
        if encoder is None:
            raise VideoFileError(f"video {source}: no frame decodes; the file is corrupt")
        writer.mux(encoder.encode())


def _encoder(writer: Any, stream: Any, width: int, height: int) -> Any:
    """An H.264 stream (MPEG-4 part 2 where PyAV has no x264) on the source's clock, without B-frames, so each
    frame is written at its own time."""
    import av

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    encoder = writer.add_stream(codec, rate=stream.average_rate or stream.guessed_rate or 30,
                                options={"crf": CRF} if codec == "libx264" else {})
    encoder.width, encoder.height = width, height
    encoder.pix_fmt = "yuv420p" if width % 2 == 0 and height % 2 == 0 else "yuv444p"
    encoder.time_base = encoder.codec_context.time_base = stream.time_base
    encoder.codec_context.max_b_frames = 0
    if codec == "mpeg4":
        encoder.codec_context.bit_rate = max(1_000_000, width * height * 8)
    return encoder


def _check_times(source: str, copy: str) -> None:
    """The copy must have every frame of the source at its time: else its labels' times would move."""
    before, after = probe(source, 1.0), probe(copy, 1.0)
    same = len(before.times) == len(after.times) and all(
        abs(a - b) <= TIME_TOLERANCE_S for a, b in zip(before.times, after.times))
    if not same:
        raise VideoFileError(f"video {source}: its upright copy has {len(after.times)} frames over {after.duration:g} "
                             f"s, the clip {len(before.times)} over {before.duration:g} s; keep it as stored with "
                             "--video-rotation raw, or rotate it yourself")
