"""Up-front record check of a pinned run: the data mistakes LF finds only mid-way (or never), named by sample.

In every stage, a token of the chat template written as text (``<|image_pad|>``, ``<|im_end|>``: the collator dies
naming no record, or a turn is forged). For SFT, three classes ``qwenvl-prep check`` reports and LF does not: a media placeholder in an assistant turn (LF trains
on the vision tokens as labels, silently); a placeholder count that differs from the record's media (a
``datasets.map`` traceback naming no record); and a ``cutoff_len`` that cuts inside a record's image tokens (the
dataset builds, then training dies with "shape mismatch"). The cutoff rule is LF 0.9.5's own
(``SupervisedDatasetProcessor._encode_data_example``: each turn pair truncated by ``infer_seqlen`` in the budget
left), run on the record's text with each image's token count from the pinned policy, so no image is decoded.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from llamafactory_qwenvl_patch.frame.families import structure_token_in
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy

SPECIAL_TOKEN_BOUND = 16  # template tokens a message can add (role tags, newlines): the cheap bound's margin


def placeholder_problems(prompt: list[dict[str, str]], response: list[dict[str, str]], media: dict[str, int],
                         tags: dict[str, str]) -> list[str]:
    """Problems of one record's placeholders: any in an assistant turn, and counts that differ from its media.
    ``media`` and ``tags`` map a kind ("image", "video", "audio") to the record's count and LF's placeholder."""
    problems = []
    for index, message in enumerate(prompt + response):
        if message.get("role") == "assistant":
            for kind, tag in tags.items():
                if tag in str(message.get("content", "")):
                    problems.append(f"{tag} in an assistant turn (message {index}): LF would train on the {kind} "
                                    "tokens as the answer; media go in user turns")
    for kind, tag in tags.items():
        written = sum(str(message.get("content", "")).count(tag) for message in prompt + response)
        if written != media.get(kind, 0):
            problems.append(f"{written} {tag} tag(s) for {media.get(kind, 0)} {kind}(s): each {kind} needs one {tag} "
                            "where it goes in the conversation")
    return problems


def template_token_problems(prompt: list[dict[str, str]], response: list[dict[str, str]], system: str | None,
                            tools: str | None) -> list[str]:
    """A token of the model's chat template written as text in any turn, the system prompt or the tools: the
    tokenizer reads it as the token itself (a stray image or video pad makes the processor count media that are not
    there and dies in the collator, naming no record; a turn end cuts the record)."""
    problems = []
    for index, message in enumerate(prompt + response):
        token = structure_token_in(str(message.get("content", "")))
        if token is not None:
            problems.append(f"{token!r} written in message {index}: a token of the model's chat template, read as "
                            "that token, not as text")
    for where, text in (("the system prompt", system), ("the tools", tools)):
        token = structure_token_in(text) if isinstance(text, str) else None
        if token is not None:
            problems.append(f"{token!r} written in {where}: a token of the model's chat template, read as that "
                            "token, not as text")
    return problems


def expand_images(messages: list[dict[str, str]], image_tokens: list[int], tag: str, start: str, pad: str,
                  end: str) -> list[dict[str, str]]:
    """The messages with each image placeholder replaced by its vision tokens, in order (what the Qwen plugins'
    ``process_messages`` writes)."""
    counts = iter(image_tokens)
    expanded = []
    for message in messages:
        content = str(message.get("content", ""))
        while tag in content:
            content = content.replace(tag, f"{start}{pad * next(counts)}{end}", 1)
        expanded.append({**message, "content": content})
    return expanded


def kept_after_cutoff(pairs: list[tuple[list[int], list[int]]], cutoff_len: int, reserved: int,
                      infer_seqlen: Callable[[int, int, int], tuple[int, int]], mask_history: bool) -> list[int]:
    """The token ids LF keeps of encoded turn pairs under ``cutoff_len`` (LF 0.9.5's loop, labels aside)."""
    kept: list[int] = []
    total = reserved
    for source, target in (pairs[::-1] if mask_history else pairs):
        if total >= cutoff_len:
            break
        source_len, target_len = infer_seqlen(len(source), len(target), cutoff_len - total)
        kept += source[:source_len] + target[:target_len]
        total += source_len + target_len
    return kept


def cheap_bound(messages: list[dict[str, str]], system: str | None, image_tokens: list[int]) -> int:
    """An upper bound on a record's tokens without tokenizing: a byte-level BPE token covers at least one byte."""
    text = sum(len(str(m.get("content", "")).encode()) for m in messages) + len((system or "").encode())
    return text + sum(n + 2 for n in image_tokens) + SPECIAL_TOKEN_BOUND * (len(messages) + 1)


def cutoff_problem(kept_pads: int, image_pads: int, needed: int, cutoff_len: int) -> str | None:
    if kept_pads == image_pads:
        return None
    return (f"cutoff_len {cutoff_len} cuts inside its image tokens (it needs {needed} tokens, {image_pads} of them "
            "image tokens): training would stop with 'Image features and image tokens do not match'; raise "
            "cutoff_len or shorten the record")


def record_rows(dataset: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, row) of LF's aligned dataset (columns ``_prompt``, ``_response``, ``_system``, ``_images``, ...)."""
    columns = dataset.column_names
    for index, row in enumerate(dataset.select_columns([c for c in ("_prompt", "_response", "_system", "_tools",
                                                                      "_images", "_videos", "_audios")
                                                         if c in columns])):
        yield index, row


def image_token_counts(images: list[Any], policy: ResizePolicy, size_of: Callable[[Any], tuple[int, int]]
                       ) -> list[int]:
    """Each image's vision-token count in the pinned frame, from its (height, width) alone."""
    return [policy.image_tokens(*size_of(image)) for image in images]


class DatasetRecordError(ValueError):
    """Records LF would train wrongly on, or fail on later, listed by sample."""


def record_problems(dataset: Any, template: Any, tokenizer: Any, data_args: Any, policy: ResizePolicy,
                    tags: dict[str, str], infer_seqlen: Callable[[int, int, int], tuple[int, int]], sft: bool = True
                    ) -> Iterator[tuple[int, list[dict[str, str]], str]]:
    """(sample index, prompt, problem) for every record problem of an aligned dataset: chat-template tokens written
    as text in every stage; for SFT (``sft``) also the placeholders and the cutoff. Only records whose
    ``cheap_bound`` passes ``cutoff_len`` are tokenized; images are read for their header size only."""
    from llamafactory_qwenvl_patch.image_io.images import ImageError, open_image

    plugin = template.mm_plugin
    pad_id = tokenizer.convert_tokens_to_ids(plugin.image_token)
    reserved = 1 if getattr(template, "efficient_eos", False) else 0
    cutoff = data_args.cutoff_len
    history_cot = bool(data_args.mask_history and not getattr(template, "preserve_thinking", False))

    def size_of(image: Any) -> tuple[int, int]:
        with open_image(image) as opened:
            return opened.height, opened.width

    for index, row in record_rows(dataset):
        prompt, response = row.get("_prompt") or [], row.get("_response") or []
        images = row.get("_images") or []
        media = {"image": len(images), "video": len(row.get("_videos") or []), "audio": len(row.get("_audios") or [])}
        problems = template_token_problems(prompt, response, row.get("_system"), row.get("_tools"))
        if sft:
            problems += placeholder_problems(prompt, response, media, tags)
        for problem in problems:
            yield index, prompt, problem
        if problems or not images or not sft:
            continue
        messages = prompt + response
        try:
            counts = image_token_counts(images, policy, size_of)
        except (ImageError, ValueError):
            continue  # the image check names it
        if cheap_bound(messages, row.get("_system"), counts) + reserved <= cutoff:
            continue
        expanded = expand_images(messages, counts, tags["image"], plugin.vision_bos_token, plugin.image_token,
                                 plugin.vision_eos_token)
        pairs = template.encode_multiturn(tokenizer, expanded, row.get("_system"), row.get("_tools"), history_cot)
        kept = kept_after_cutoff(pairs, cutoff, reserved, infer_seqlen, bool(data_args.mask_history))
        needed = reserved + sum(len(source) + len(target) for source, target in pairs)
        problem = cutoff_problem(kept.count(pad_id), sum(counts), needed, cutoff)
        if problem:
            yield index, prompt, problem
