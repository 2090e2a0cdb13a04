"""What a pinned API server refuses in a request before LF's handler reads it: client mistakes LF would answer with a
500 or a misleading message, and local paths its media check lets through.

Pure functions over the request's parsed messages (objects with ``role``, ``content`` and, per content item,
``type`` and ``image_url`` / ``video_url`` / ``audio_url``), so they are tested without a server.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, NamedTuple

from llamafactory_qwenvl_patch.frame.families import structure_token_in

LF_DATA_URL_TYPES = ("png", "jpg", "jpeg", "gif", "bmp")  # api/chat.py's base64 pattern in LF 0.9.5
# a video data URL's media types, by container the plugin reads: the registered names and LF's own (LF's pattern knows
# video/mp4, mkv, avi and mov only, and tried any other data URL as a web address)
VIDEO_DATA_URL_TYPES = {"video/mp4": "mp4", "video/webm": "webm", "video/x-matroska": "mkv", "video/matroska": "mkv",
                        "video/mkv": "mkv", "video/quicktime": "mov", "video/mov": "mov", "video/x-msvideo": "avi",
                        "video/msvideo": "avi", "video/avi": "avi"}
LF_VIDEO_DATA_URL = "data:video/mp4;base64,"  # a prefix LF's pattern decodes; PyAV finds the container in the bytes
MEDIA_KINDS = ("image_url", "video_url", "audio_url")
REMOTE_SCHEMES = ("http://", "https://")
MEDIA_REFUSED = ("a local media path is served only when it names a file inside the server's SAFE_MEDIA_PATH (and "
                 "ALLOW_LOCAL_FILES is on); send the file as a data URL or an http(s) URL")


def _items(request: Any) -> Iterator[tuple[Any, Any]]:
    for message in getattr(request, "messages", None) or []:
        content = getattr(message, "content", None)
        for item in content if isinstance(content, list) else []:
            yield message, item


def _media_urls(request: Any) -> Iterator[tuple[str, str]]:
    for _, item in _items(request):
        kind = getattr(item, "type", None)
        if kind in MEDIA_KINDS:
            url = getattr(getattr(item, kind, None), "url", None)
            if isinstance(url, str):
                yield kind, url


def _data_url_parts(url: str) -> tuple[str, list[str], str]:
    """(media type as written, its parameters in order as written, the data) of a data URL (RFC 2397). The header
    ends at ``;base64,`` where there is one (a parameter may hold a comma: ``codecs=vp8,opus``), else at the first
    comma."""
    body = url[5:]
    header, marker, data = body.partition(";base64,")
    if marker:
        header += ";base64"
    else:
        header, _, data = body.partition(",")
    media_type, *parameters = header.split(";")
    return media_type, parameters, data


def _encoding_problem(kind: str, parameters: list[str], data: str) -> str | None:
    """Why the data of a data URL of a readable type is not read, or None: it must be base64 and not empty. A video
    may carry other parameters before ``;base64`` (``video/webm;codecs=vp9``: the prefix is replaced before LF
    reads it); LF's image pattern takes ``;base64`` alone, exactly so written."""
    if not data:
        return "empty"
    if not parameters or parameters[-1].strip().lower() != "base64":
        return "not base64"
    if kind == "image_url" and parameters != ["base64"]:
        return f"parameters {';'.join(parameters)}: LLaMA-Factory's pattern takes ';base64' alone"
    return None


class UnreadDataUrl(NamedTuple):
    """A data URL the pinned API does not decode: its content part's kind, its media type (``typeless``) and, for a
    type it reads, what is wrong with its data (None: the type itself is not read)."""

    kind: str
    media_type: str
    problem: str | None = None


def unread_data_urls(request: Any) -> list[UnreadDataUrl]:
    """Each data URL the pinned API does not decode: an image of a type LF's pattern does not know
    (``data:image/webp``: LF then tries it as a web address and answers "Only HTTP/HTTPS URLs are allowed"), a video
    of a container the plugin does not read, one not in base64 or empty (LF's pattern too), or a typeless one."""
    found = []
    for kind, url in _media_urls(request):
        if not url.startswith("data:") or kind not in ("image_url", "video_url"):
            continue
        media_type, parameters, data = _data_url_parts(url)
        if kind == "image_url":
            read = media_type.startswith("image/") and media_type[6:] in LF_DATA_URL_TYPES
        else:
            read = media_type.lower() in VIDEO_DATA_URL_TYPES
        problem = _encoding_problem(kind, parameters, data) if read else None
        if not read or problem:
            found.append(UnreadDataUrl(kind, media_type or "typeless", problem))
    return found


def unread_data_url_message(kind: str, media_type: str, problem: str | None = None) -> str:
    """The 400's text for an ``unread_data_urls`` entry: what was sent and what is read."""
    what = "an image" if kind == "image_url" else "a video"
    if problem is not None:  # a type the API reads, its data not as it must be
        return (f"{what} sent as a {media_type} data URL whose data is {problem}: send the file's bytes "
                f"base64-encoded, as data:{media_type};base64,<data>")
    if kind == "image_url":
        return (f"an image sent as a {media_type} data URL: LLaMA-Factory's API reads base64 data URLs of "
                f"{', '.join(LF_DATA_URL_TYPES)} only (it would try the URL as a web address); send it as base64 PNG "
                "or JPEG")
    containers = ", ".join(dict.fromkeys(VIDEO_DATA_URL_TYPES.values()))
    return (f"a video sent as a {media_type} data URL: the pinned API reads base64 data URLs of the containers it "
            f"decodes, {containers} (media types {', '.join(VIDEO_DATA_URL_TYPES)}); send the clip in one of them, "
            "base64-encoded")


def relabel_video_data_urls(request: Any) -> None:
    """Give every video data URL the plugin reads (``unread_data_urls`` found none other) a prefix LF's pattern
    decodes, in place: LF tried a webm, or a mov sent as ``video/quicktime``, as a web address. Only the name
    changes; PyAV finds the container from the bytes."""
    for _, item in _items(request):
        media = getattr(item, "video_url", None) if getattr(item, "type", None) == "video_url" else None
        url = getattr(media, "url", None)
        if isinstance(url, str) and url.startswith("data:") and not url.startswith(LF_VIDEO_DATA_URL):
            media.url = LF_VIDEO_DATA_URL + _data_url_parts(url)[2]


def inside(path: str, root: str) -> bool:
    """Whether ``path``, every link resolved, is a regular file inside ``root`` (resolved too). LF 0.9.5 compares
    the strings' prefixes, so ``.../media_private/x`` passes a ``.../media`` root."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    try:
        contained = os.path.commonpath([real, base]) == base
    except ValueError:  # different drives
        return False
    return contained and os.path.isfile(real)


def refused_local_media(request: Any, safe_root: str, allow_local: bool) -> str | None:
    """The first media URL that is a local path LF must not read, or None. Every refusal gets the same answer
    (``MEDIA_REFUSED``): LF's two messages (a missing path is "Only HTTP/HTTPS URLs are allowed", an existing one
    outside the root "Invalid or inaccessible file path") told a client which server paths exist."""
    for _, url in _media_urls(request):
        if url.startswith("data:") or url.startswith(REMOTE_SCHEMES):
            continue
        if not allow_local or not inside(url, safe_root):
            return url
    return None


def literal_placeholders(request: Any, placeholders: tuple[str, ...]) -> list[tuple[int, str]]:
    """(message index, placeholder) for each media placeholder (``<image>``, ``<video>``, ``<audio>``) written as
    text in a non-system message: LF counts them as media slots, finds fewer media than slots and fails with a
    500."""
    found = []
    for index, message in enumerate(getattr(request, "messages", None) or []):
        if str(getattr(message, "role", "")).lower().endswith("system"):
            continue
        texts = _texts(message)
        found += [(index, tag) for tag in placeholders if any(tag in text for text in texts)]
    return found


def _texts(message: Any) -> list[str]:
    content = getattr(message, "content", None)
    return [content] if isinstance(content, str) else [
        getattr(item, "text", None) or "" for item in content or [] if getattr(item, "type", None) == "text"]


def template_tokens(request: Any) -> list[tuple[str, str]]:
    """(where, token) for each token of the model's chat template (``<|im_end|>``, ``<|image_pad|>``, ...) written
    as text in any message (the system's included), a message's tool calls or the request's tools: LF renders all of
    them into the prompt, the tokenizer reads such a token as itself, so a client could forge a turn, and a stray
    image or video pad stalls the processor (a request that never answers, and every request after it)."""
    found = []
    for index, message in enumerate(getattr(request, "messages", None) or []):
        texts = _texts(message) + [_dumped(call) for call in getattr(message, "tool_calls", None) or []]
        token = next((t for t in map(structure_token_in, texts) if t is not None), None)
        if token is not None:
            found.append((f"message {index}", token))
    for index, tool in enumerate(getattr(request, "tools", None) or []):
        token = structure_token_in(_dumped(tool))
        if token is not None:
            found.append((f"tool {index}", token))
    return found


def _dumped(value: Any) -> str:
    """A request object (pydantic, a dict or other) as the text LF renders of it."""
    dump = getattr(value, "model_dump_json", None)
    return dump() if callable(dump) else str(value)
