"""What a pinned API server refuses in a request before LF's handler reads it: client mistakes LF would answer with a
500 or a misleading message, and local paths its media check lets through.

Pure functions over the request's parsed messages (objects with ``role``, ``content`` and, per content item,
``type`` and ``image_url`` / ``video_url`` / ``audio_url``), so they are tested without a server.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

LF_DATA_URL_TYPES = ("png", "jpg", "jpeg", "gif", "bmp")  # api/chat.py's base64 pattern in LF 0.9.5
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


def unread_data_urls(request: Any) -> list[str]:
    """The media types of image data URLs that LF's API would not decode (``data:image/webp``: LF then tries it as
    a web address and answers "Only HTTP/HTTPS URLs are allowed")."""
    found = []
    for kind, url in _media_urls(request):
        if kind == "image_url" and url.startswith("data:"):
            media_type = url[5:].split(";", 1)[0].split(",", 1)[0]
            if not (media_type.startswith("image/") and media_type[6:] in LF_DATA_URL_TYPES):
                found.append(media_type or "typeless")
    return found


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
        content = getattr(message, "content", None)
        texts = [content] if isinstance(content, str) else [
            getattr(item, "text", None) or "" for item in content or [] if getattr(item, "type", None) == "text"]
        found += [(index, tag) for tag in placeholders if any(tag in text for text in texts)]
    return found
