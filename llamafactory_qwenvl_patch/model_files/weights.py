"""Whether a folder's weight files are whole, read from their headers before any loader starts: a safetensors file
cut short (an interrupted copy or download) stopped transformers with "incomplete metadata" deep in its loader, and
vLLM only after its engine had started; a sharded checkpoint whose index names a shard that is not there, likewise.

A safetensors file is an 8-byte little-endian header length, a JSON header giving every tensor's byte range, then
the data: the file is whole when it is at least as long as the header says and the last tensor ends.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

INDEX_SUFFIX = ".index.json"  # model.safetensors.index.json: its weight_map names each tensor's shard
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header


def safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file at ``path`` cannot be whole (its size against what its header says), or None."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path}: is {size} bytes, shorter than a safetensors header (cut short?)"
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                return (f"{path}: its header says {length:,} bytes of metadata, the file is {size:,} bytes in all: it is "
                        "cut short or not a safetensors file")
            header = json.loads(f.read(length))
    except OSError as exc:
        return f"{path}: cannot be read ({exc.strerror or exc})"
    except (ValueError, UnicodeDecodeError):
        return f"{path}: its header is not JSON: it is corrupt or not a safetensors file"
    if not isinstance(header, dict):
        return f"{path}: its header is not a JSON object: it is corrupt"
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2 and isinstance(entry["data_offsets"][1], int)]
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        return (f"{path}: is {size:,} bytes, its tensors end at byte {needed:,}: it is cut short (an interrupted copy "
                "or download?); copy it again")
    return None


def weights_problems(folder: Path) -> list[str]:
    """What is wrong with the weights of ``folder`` (a model or an adapter folder): each safetensors file cut short
    or corrupt, and each shard its index names that is not there. [] when they look whole (``.bin`` files are
    pickles, not checked)."""
    problems = []
    for index in sorted(folder.glob(f"*.safetensors{INDEX_SUFFIX}")):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            problems.append(f"{index}: is not a readable JSON index of the shards")
            continue
        problems += [f"{index}: names the shard {shard}, which is not in {folder}" for shard in sorted(shards)
                     if isinstance(shard, str) and not (folder / shard).is_file()]
    problems += [problem for path in sorted(folder.glob("*.safetensors"))
                 if (problem := safetensors_problem(path)) is not None]
    return problems
