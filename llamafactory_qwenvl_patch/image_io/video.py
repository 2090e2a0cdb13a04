"""Reading a clip as the video policy samples it: every frame's real presentation time (from the packets, not the
header: webm and mkv report no frame count or duration, and a header's rate is wrong for variable-rate clips), then
only the sampled frames decoded and each resized exactly like a still image in the policy's frame.

A clip is a video file or a frame list (pre-extracted frames, a list of image paths, taken at a stated rate).
Errors name the clip and say what is wrong.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

from PIL import Image

from llamafactory_qwenvl_patch.frame.policy import PolicyError
from llamafactory_qwenvl_patch.frame.video import VideoError, VideoPlan, VideoPolicy, clip_duration, frame_list_times
from llamafactory_qwenvl_patch.image_io.images import (
    ImageError, check_pixels, describe, model_input_image, open_image, require_regular_file,
)
from llamafactory_qwenvl_patch.image_io.video_header import stated_length, truncation


class VideoFileError(ImageError):
    """A clip that cannot be read (missing, not a regular file, undecodable, no video stream, no frames)."""


@dataclass(frozen=True)
class Clip:
    """What the policy needs to know of a clip before decoding any pixels."""

    name: str
    height: int
    width: int
    times: tuple[float, ...]  # each frame's presentation time in seconds from the first, sorted
    duration: float
    frames: tuple[Any, ...] = ()  # a frame list's images (empty for a video file)
    pts: tuple[int, ...] = ()  # a video file's presentation timestamps, sorted (what decoded frames are matched by)

    def plan(self, policy: VideoPolicy) -> VideoPlan:
        try:
            policy.frame_size(self.height, self.width)
            return policy.plan(self.times, self.duration)
        except PolicyError as exc:
            raise VideoError(f"video {self.name}: {exc}") from None


def is_frame_list(video: Any) -> bool:
    """LF's own test (``_check_video_is_nested_images``): a video given as a list or tuple of images."""
    return isinstance(video, (list, tuple))


MAX_STREAM_BYTES = 2**31  # a video sent as a stream that cannot rewind is read into memory up to this size


def rewindable(video: Any) -> Any:
    """A video that can be read more than once (probed, then decoded): a stream that cannot seek (an HTTP response,
    as LF's API gives a video URL) is read into memory first, refused by name past ``MAX_STREAM_BYTES``."""
    if not hasattr(video, "read") or (hasattr(video, "seekable") and video.seekable()):
        return video
    from io import BytesIO

    data = video.read(MAX_STREAM_BYTES + 1)
    if len(data) > MAX_STREAM_BYTES:
        raise VideoFileError(f"video {describe(video)}: a stream over {MAX_STREAM_BYTES} bytes; save it to a file")
    return BytesIO(data)


def probe(video: Any, frame_list_fps: float) -> Clip:
    """A clip's size and frame times: from the packets of a video file (no decoding), or from a frame list's image
    headers at ``frame_list_fps``. A stream that cannot rewind must go through ``rewindable`` first."""
    if is_frame_list(video):
        return _probe_frame_list(video, frame_list_fps)
    return _probe_file(video)


def _open_container(video: Any, name: str) -> Any:
    import av

    if isinstance(video, (str, os.PathLike)):
        try:
            require_regular_file(video, "video")
        except ImageError as exc:
            raise VideoFileError(str(exc)) from None
        if os.path.getsize(video) == 0:
            raise VideoFileError(f"video {name}: is empty (0 bytes)")
    try:
        if hasattr(video, "seek"):  # a stream (LF's API decodes a base64 video into one): probed, then decoded
            video.seek(0)
        return av.open(video if not isinstance(video, os.PathLike) else os.fspath(video), "r")
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise VideoFileError(f"video {name}: cannot open ({exc})") from None


def _video_stream(container: Any, name: str) -> Any:
    kind = getattr(container.format, "name", "") or ""
    if kind.endswith("_pipe") or kind in ("image2", "image2pipe"):  # still-image demuxers: png_pipe, jpeg_pipe, ...
        raise VideoFileError(f"video {name}: is a still image ({kind.removesuffix('_pipe')}), not a video: put it "
                             "in 'images', or a list of frames in 'videos'")
    stream = next((s for s in container.streams if s.type == "video"), None)
    if stream is None and not container.streams:  # ffmpeg's mp4 muxer leaves out a stream that got no frame
        raise VideoFileError(f"video {name}: has no frames (the file lists no stream at all: a recording that "
                             "stopped before its first frame?)")
    if stream is None:
        kinds = ", ".join(sorted({str(s.type) for s in container.streams}))
        raise VideoFileError(f"video {name}: has no video stream (only {kinds})")
    if stream.codec_context is None:  # decoding it would crash the process (PyAV 16)
        raise VideoFileError(f"video {name}: is truncated or corrupt: its video stream names no codec ffmpeg can "
                             "decode (its description is cut short, or the codec is unknown)")
    return stream


@dataclass(frozen=True)
class _Packets:
    """What a video stream's packets say, read without decoding."""

    pts: tuple[int, ...]  # the shown frames' timestamps (empty packets and edit-list cuts left out)
    end: int | None  # the latest timestamp plus its packet's duration
    count: int  # every packet the demuxer gave, as a header's frame count lists them
    short: int | None  # the first packet the demuxer flags corrupt (a short read: the file ends inside it)


def _read_packets(container: Any, stream: Any, name: str) -> _Packets:
    import av

    pts: list[int] = []
    end, count, short = None, 0, None
    try:
        for packet in container.demux(stream):
            if packet.pts is None and not packet.size:  # the demuxer's closing empty packet
                continue
            if packet.is_corrupt and short is None:
                short = count
            count += 1
            if packet.pts is not None and packet.size and not packet.is_discard:  # edit-list cuts: not shown
                pts.append(packet.pts)
                stop = packet.pts + (packet.duration or 0)
                end = stop if end is None else max(end, stop)
    except (av.FFmpegError, OSError) as exc:
        raise VideoFileError(f"video {name}: cannot read its packets ({exc}); the file is truncated or "
                             "corrupt") from None
    return _Packets(tuple(pts), end, count, short)


def _probe_file(video: Any) -> Clip:
    name = describe(video)
    container = _open_container(video, name)
    try:
        stream = _video_stream(container, name)
        packets = _read_packets(container, stream, name)
        width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
        base = float(stream.time_base) if stream.time_base else 0.0
        start = stream.start_time
        stated = stated_length(container, stream)
    finally:
        container.close()
    pts = sorted(packets.pts)
    if not pts:
        raise VideoFileError(f"video {name}: {truncation(stated, 0, 0.0, 0.0) or 'its video stream has no frames'}")
    if base <= 0:
        raise VideoFileError(f"video {name}: its stream states no time base; the file is corrupt")
    times = tuple((p - pts[0]) * base for p in pts)
    duration = clip_duration(times)
    start = pts[0] if start is None else start
    cut = truncation(stated, packets.count, max((pts[0] - start) * base + duration, (packets.end - start) * base),
                     duration - times[-1])
    if cut:
        raise VideoFileError(f"video {name}: {cut}")
    if packets.short is not None:
        raise VideoFileError(f"video {name}: is truncated or corrupt: its packet {packets.short + 1} of "
                             f"{packets.count} is cut short (an interrupted copy or download?)")
    if width <= 0 or height <= 0:
        raise VideoFileError(f"video {name}: its stream has no frame size ({width}x{height})")
    check_pixels(width, height, name, "video")
    return Clip(name, height, width, times, duration, pts=tuple(pts))


class DisplayMatrix(NamedTuple):
    """How a player shows a clip's stored frames (its display matrix): turned ``degrees`` clockwise (0, 90, 180 or
    270 for a phone clip), and whether it also mirrors them (a matrix of negative determinant: a front camera's
    selfie clip, an editor's flip). Training reads the stored frames."""

    degrees: int = 0
    mirrored: bool = False

    @property
    def shown_as_stored(self) -> bool:
        return not self.degrees and not self.mirrored

    def in_words(self) -> str:
        """What players do to the stored frames: 'turn it 90 degrees clockwise', or 'mirror it' (its turn, read as
        if it had no mirror, means nothing then)."""
        return "mirror it" if self.mirrored else f"turn it {self.degrees} degrees clockwise"


def display_matrix(video: Any) -> DisplayMatrix:
    """A clip's display matrix as players apply it. PyAV gives the matrix on decoded frames only, so the first frame
    is decoded: one that does not decode is a VideoFileError (the clip would fail in training). Frame lists have
    none. The turn is PyAV's reading of the matrix (``av_display_rotation_get``, which assumes no mirror); the
    mirror is the sign of the matrix's 2 x 2 determinant."""
    import struct

    import av

    if is_frame_list(video):
        return DisplayMatrix()
    video = rewindable(video)
    name = describe(video)
    container = _open_container(video, name)
    try:
        stream = _video_stream(container, name)
        try:
            frame = next(container.decode(stream), None)
        except (av.FFmpegError, OSError) as exc:
            raise VideoFileError(f"video {name}: its first frame does not decode ({exc}); the file is corrupt"
                                 ) from None
    finally:
        container.close()
    if frame is None:
        raise VideoFileError(f"video {name}: no frame decodes; the file is corrupt")
    mirrored = False
    for side in frame.side_data:
        if str(side.type).endswith("DISPLAYMATRIX") and len(bytes(side)) == 36:
            a, b, _, c, d, _, _, _, _ = struct.unpack("=9i", bytes(side))  # 16.16 fixed point, native order
            mirrored = a * d - b * c < 0
    return DisplayMatrix(round(-frame.rotation) % 360, mirrored)


def clip_name(video: Any) -> str:
    """A short human name for a clip: a file's ``describe``, or a frame list's length and first frame."""
    if not is_frame_list(video):
        return describe(video)
    return f"frame list ({len(video)} frames, first {describe(video[0]) if video else 'none'})"


def _probe_frame_list(frames: Sequence[Any], fps: float) -> Clip:
    name = clip_name(frames)
    if not frames:
        raise VideoFileError("video frame list is empty")
    sizes = []
    for index, frame in enumerate(frames):
        try:
            image = open_image(frame)
            sizes.append((image.height, image.width))
            if image is not frame:  # opened here (header only): an image the caller passed stays open
                image.close()
        except ImageError as exc:
            raise VideoFileError(f"{name}: frame {index}: {exc}") from None
        if sizes[-1] != sizes[0]:
            raise VideoFileError(f"{name}: frame {index} is {sizes[-1][1]}x{sizes[-1][0]}, frame 0 is "
                                 f"{sizes[0][1]}x{sizes[0][0]}; a clip's frames share one size")
    try:
        times = tuple(frame_list_times(len(frames), fps))
    except VideoError as exc:
        raise VideoFileError(f"{name}: {exc}") from None
    return Clip(name, sizes[0][0], sizes[0][1], times, len(frames) / fps, tuple(frames))


def read_clip(video: Any, policy: VideoPolicy, frame_list_fps: float,
              transform: Callable[[Any], Any] | None = None, clip: Clip | None = None) -> tuple[list[Any], VideoPlan]:
    """The sampled frames of a clip, each the RGB image the encoder sees (the policy's frame), and the plan. With
    ``transform``, each sampled frame (a decoded PIL image, or a frame list's item as given) is ``transform(frame)``
    instead, applied as it is decoded so that only what it returns is kept (``qwenvl-prep draw`` keeps original-size
    frames one at a time). ``clip``: the video's ``probe`` when the caller has it already (its packets are not read
    again)."""
    video = rewindable(video)
    clip = clip or probe(video, frame_list_fps)
    plan = clip.plan(policy)
    frame_policy = policy.frame_policy

    def each(index: int, frame: Any) -> Any:
        try:
            return model_input_image(frame, frame_policy) if transform is None else transform(frame)
        except ImageError as exc:
            raise VideoFileError(f"{clip.name}: frame {index}: {exc}") from None

    if clip.frames:
        resized = {index: each(index, clip.frames[index]) for index in sorted(set(plan.indices))}
    else:
        resized = _decode(video, clip, set(plan.indices), each)
    return [resized[index] for index in plan.indices], plan


def _decode(video: Any, clip: Clip, wanted: set[int], each: Callable[[int, Image.Image], Any]) -> dict[int, Any]:
    """Decode in presentation order up to the last wanted frame, keeping ``each(index, frame)`` of the wanted ones
    (so a clip's decoded frames are never all held at full size)."""
    import av

    container = _open_container(video, clip.name)
    found: dict[int, Any] = {}
    last = max(wanted)
    try:
        stream = _video_stream(container, clip.name)
        index_of = {pts: index for index, pts in enumerate(clip.pts)}
        for order, frame in enumerate(container.decode(stream)):
            # by presentation time, as probed (a decoder that drops or adds frames cannot shift the clock); a frame
            # without one by its place in presentation order
            index = index_of.get(frame.pts, order) if frame.pts is not None else order
            if index in wanted:
                found[index] = each(index, frame.to_image())
            if index >= last:
                break
    except (av.FFmpegError, OSError) as exc:
        raise VideoFileError(f"video {clip.name}: cannot decode ({exc}); the file is truncated or corrupt") from None
    finally:
        container.close()
    missing = sorted(wanted - set(found))
    if missing:
        raise VideoFileError(f"video {clip.name}: its packets list {len(clip.times)} frames but frame {missing[0]} "
                             "does not decode; the file is truncated or corrupt")
    return found


def unexpected_read_problem(name: str, exc: Exception) -> str:
    """A problem naming an error the plugin does not expect from reading a clip (a bug in it or in PyAV): listed with
    the clip's name, its type and where it was raised, so the run still stops and the report can be filed."""
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return (f"video {name}: reading it raised {type(exc).__name__}: {exc} (at {os.path.basename(where.filename)}:"
            f"{where.lineno}); a bug in the plugin or PyAV, please report it with the clip")
