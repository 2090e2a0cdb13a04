"""``check``'s video side: each clip probed from its packets (a clip cut short is a problem: ``probe`` compares the
packets with its header), its first frame decoded for its display rotation (every sampled frame with ``--decode``),
a header that disagrees with the packets within that rule and a rotated clip noted (not problems: the plugin samples
by packet times, and a clip kept as stored is a choice, ``convert --video-rotation raw``), its video tokens under the
run's video policy, and a single-video record's labels inside the clip (times) and the video frame (boxes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from llamafactory_qwenvl_patch.frame.policy import PolicyError, check_box, check_point
from llamafactory_qwenvl_patch.frame.stamp import Stamp
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.image_io.images import ImageError
from llamafactory_qwenvl_patch.image_io.video import (
    Clip,
    clip_name,
    display_matrix,
    probe,
    read_clip,
    unexpected_read_problem,
)
from llamafactory_qwenvl_patch.image_io.video_header import stated_length
from qwenvl_prep.formats.converted import Sample
from qwenvl_prep.formats.video_labels import LabelError, clip_problems, frame_interval, video_labels

MAX_CACHED = 4096


def header_length(path: str) -> tuple[int, float | None]:
    """(frames, seconds) a video file's header states (``video_header.stated_length``): 0 and None where it says
    nothing, as webm and mkv headers say no frame count."""
    import av

    with av.open(path, "r") as container:
        stated = stated_length(container, next(s for s in container.streams if s.type == "video"))
        return stated.frames, stated.seconds


def _name(video: Any) -> str:
    return video if isinstance(video, str) else f"{video[0] if video else '?'} (frame list of {len(video)})"


@dataclass
class VideoChecker:
    """One dataset's clips under the run's video policy (``run``) and the frame its labels are in (``data``)."""

    run: Stamp
    data: Stamp
    full_decode: bool = False
    count_text: Callable[[str], int] = lambda text: len(text) // 3 + 1  # the tokenizer's count, where check has one
    videos: int = 0
    notes: list[dict] = field(default_factory=list)
    _clips: dict[Any, Clip | str] = field(default_factory=dict)

    @property
    def policy(self) -> VideoPolicy:
        if self.run.video is None:
            raise PolicyError("the run has no video policy")
        return self.run.video

    @property
    def list_fps(self) -> float:
        """The rate the dataset's frame lists were labelled at (its stamp's), else the run's."""
        fps = self.data.frame_list_fps or self.run.frame_list_fps
        return float(fps if fps is not None else self.policy.fps)

    def clip(self, video: Any, sample: int) -> Clip | str:
        """The probed clip, or why it cannot be used (cached per clip: many records ask about one clip)."""
        key = tuple(video) if isinstance(video, list) else video
        if key in self._clips:
            return self._clips[key]
        try:
            found: Clip | str = probe(video, self.list_fps)
            found.plan(self.policy)
            display = display_matrix(video)
            if self.full_decode:
                read_clip(video, self.policy, self.list_fps, clip=found)
        except (ImageError, PolicyError) as exc:
            found = str(exc)
        except Exception as exc:  # noqa: BLE001 - one clip's unforeseen error must not lose the report
            found = unexpected_read_problem(clip_name(video), exc)
        else:
            if isinstance(video, str):
                self._header_note(video, found, sample)
            if not display.shown_as_stored:
                how = "mirrored" if display.mirrored else "rotated"
                fix = "flip the clip yourself" if display.mirrored else "convert with --video-rotation bake"
                self.notes.append({"sample": sample, "video": video, "note": (
                    f"it is stored {how}: players {display.in_words()} (its display matrix), training reads the "
                    f"stored frames; right if its labels are on the stored frames (convert --video-rotation raw), "
                    f"else {fix}")})
        if len(self._clips) > MAX_CACHED:
            self._clips.clear()
        self._clips[key] = found
        return found

    def _header_note(self, path: str, clip: Clip, sample: int) -> None:
        try:
            frames, seconds = header_length(path)
        except Exception as exc:  # noqa: BLE001 - PyAV's many errors: the packets were read, so only a note
            self.notes.append({"sample": sample, "video": path, "note": f"its header cannot be read ({exc})"})
            return
        interval = frame_interval(clip.times, clip.duration)
        said = []
        if frames and frames != len(clip.times):
            said.append(f"{frames} frames")
        if seconds is not None and abs(seconds - clip.duration) > interval + 0.05:
            said.append(f"{seconds:g} s")
        if said:
            self.notes.append({"sample": sample, "video": path, "note": (
                f"its header says {' and '.join(said)}, its packets {len(clip.times)} frames over "
                f"{clip.duration:g} s; the plugin samples by packet times, stock LLaMA-Factory by the header")})
        elif not frames:
            self.notes.append({"sample": sample, "video": path, "note": (
                "its header gives no frame count (webm, mkv): stock LLaMA-Factory would read its first video_maxlen "
                "frames as the whole clip; the plugin samples by packet times")})

    def scan(self, sample: Sample) -> tuple[int, list[tuple[str, str]]]:
        """(video tokens, [(video, problem)]) of one record."""
        tokens, problems = 0, []
        clips = []
        for video in sample.videos:
            self.videos += 1
            clip = self.clip(video, sample.index)
            if isinstance(clip, str):
                problems.append((_name(video), clip))
                continue
            clips.append(clip)
            plan = clip.plan(self.policy)
            tokens += plan.tokens(self.policy.frame_tokens(clip.height, clip.width))
            if self.policy.clock == "stamps":  # Qwen3: each group is its stamp, vision start, its tokens, vision end
                tokens += sum(self.count_text(text) + 2 for text in plan.stamp_texts)
            else:
                tokens += 2
        if len(sample.videos) == 1 and len(clips) == 1:
            problems += [(clips[0].name, f"video {clips[0].name}: {p}") for p in self._label_problems(sample, clips[0])]
        return tokens, problems

    def _label_problems(self, sample: Sample, clip: Clip) -> list[str]:
        out = []
        for text in sample.turns:
            try:
                out += clip_problems(video_labels(text), clip.duration, frame_interval(clip.times, clip.duration))
            except LabelError as exc:
                out.append(str(exc))
        if sample.images:
            return out  # boxes then belong to an image or the video: the image side checks none either
        video = self.data.video or self.policy
        hw = (clip.height, clip.width)
        frame = video.frame_size(*hw)
        for item in sample.turn_items:
            try:
                (check_box if item.kind == "bbox_2d" else check_point)(item.coords, self.data.coords, hw, frame)
            except PolicyError as exc:
                out.append(f"{exc} (the video frame {frame[1]}x{frame[0]} of a {hw[1]}x{hw[0]} clip)")
        return out
