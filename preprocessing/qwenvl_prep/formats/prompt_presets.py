"""Benchmark prompt presets: the prompts that published Qwen-VL numbers on RefCOCO / RefCOCO+ / RefCOCOg,
ScreenSpot / ScreenSpot-v2 / ScreenSpot-Pro and temporal grounding (Charades-STA, ActivityNet Captions, QVHighlights,
as TimeLens measured them) were measured with, per model family, each with its source.

A benchmark number moves with its prompt (a Qwen2.5-VL-3B REC score went from 73.7 to 82.1 by prompt alone), so a
number is comparable with a published one only under the same prompt. A preset is the prompt's user text (the
record's instruction or referring expression in ``{instruction}``), its system prompt and assistant prefill where the
source uses them, and how its answer is read. Where no source publishes a prompt for a (benchmark, family) pair
there is no preset: any prompt we chose would be our own, which convert's default prompts already are.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from llamafactory_qwenvl_patch.scoring import json_text
from qwenvl_prep.formats.benchmarks import INSTRUCTION_KEY
from qwenvl_prep.formats.temporal import QUERY_KEY

BENCHMARK_FORMATS = {"refcoco": ("refcoco-parquet",), "screenspot": ("screenspot", "screenspot-pro"),
                     "timelens": ("charades-sta", "activitynet-captions", "qvhighlights")}
PRESET_NAMES = tuple(BENCHMARK_FORMATS)
ANSWERS = {
    "json": "bbox_2d / point_2d JSON in the family's coordinates",
    "box_tokens": "<|box_start|>(x1,y1),(x2,y2)<|box_end|>, 0-1000 (a box's centre is its click)",
    "computer_use": "a computer_use tool call; its coordinate (model-frame pixels) is the click",
    "event_text": "'The event happens in <start time> - <end time> seconds' in words; its first time pair is the span",
}

# ScreenSpot-Pro's Qwen2.5-VL system prompt (likaixin2000/ScreenSpot-Pro-GUI-Grounding models/qwen2_5vl.py at
# bd8bbbb, lines 20-66: its two system texts joined, as the chat template joins them): the Qwen2.5-VL cookbook's
# computer_use tool, the screen's resolution being the image the model sees.
COMPUTER_USE_SYSTEM = (
    "You are a helpful assistant.\n\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
    "XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name_for_human\": \"computer_use\", "
    "\"name\": \"computer_use\", \"description\": \"Use a mouse and keyboard to interact with a "
    "computer, and take screenshots.\n* This is an interface to a desktop GUI. You do not "
    "have access to a terminal or applications menu. You must click on desktop icons to start "
    "applications.\n* Some applications may take time to start or process actions, so you "
    "may need to wait and take successive screenshots to see the results of your actions. "
    "E.g. if you click on Firefox and a window doesn't open, try wait and taking another "
    "screenshot.\n* The screen's resolution is {screen_width}x{screen_height}.\n* Whenever "
    "you intend to move the cursor to click on an element like an icon, you should consult "
    "a screenshot to determine the coordinates of the element before moving the cursor.\n* "
    "If you tried clicking on a program or link but it failed to load, even after waiting, "
    "try adjusting your cursor position so that the tip of the cursor visually falls on the "
    "element that you want to click.\n* Make sure to click any buttons, links, icons, etc "
    "with the cursor tip in the center of the element. Don't click boxes on their edges unless "
    "asked.\", \"parameters\": {\"properties\": {\"action\": {\"description\": \"The action to perform. "
    "The available actions are:\n* `key`: Performs key down presses on the arguments passed "
    "in order, then performs key releases in reverse order.\n* `type`: Type a string of text "
    "on the keyboard.\n* `mouse_move`: Move the cursor to a specified (x, y) pixel coordinate "
    "on the screen.\n* `left_click`: Click the left mouse button.\n* `left_click_drag`: Click "
    "and drag the cursor to a specified (x, y) pixel coordinate on the screen.\n* `right_click`: "
    "Click the right mouse button.\n* `middle_click`: Click the middle mouse button.\n* `double_click`: "
    "Double-click the left mouse button.\n* `scroll`: Performs a scroll of the mouse scroll "
    "wheel.\n* `wait`: Wait specified seconds for the change to happen.\n* `terminate`: Terminate "
    "the current task and report its completion status.\", \"enum\": [\"key\", \"type\", \"mouse_move\", "
    "\"left_click\", \"left_click_drag\", \"right_click\", \"middle_click\", \"double_click\", \"scroll\", "
    "\"wait\", \"terminate\"], \"type\": \"string\"}, \"keys\": {\"description\": \"Required only by `action=key`.\","
    " \"type\": \"array\"}, \"text\": {\"description\": \"Required only by `action=type`.\", \"type\": "
    "\"string\"}, \"coordinate\": {\"description\": \"(x, y): The x (pixels from the left edge) "
    "and y (pixels from the top edge) coordinates to move the mouse to. Required only by "
    "`action=mouse_move` and `action=left_click_drag`.\", \"type\": \"array\"}, \"pixels\": {\"description\": "
    "\"The amount of scrolling to perform. Positive values scroll up, negative values scroll "
    "down. Required only by `action=scroll`.\", \"type\": \"number\"}, \"time\": {\"description\": "
    "\"The seconds to wait. Required only by `action=wait`.\", \"type\": \"number\"}, \"status\": "
    "{\"description\": \"The status of the task. Required only by `action=terminate`.\", \"type\": "
    "\"string\", \"enum\": [\"success\", \"failure\"]}}, \"required\": [\"action\"], \"type\": \"object\"}, "
    "\"args_format\": \"Format the arguments as a JSON object.\"}}\n</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
)
COMPUTER_USE_PREFILL = '<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": ['


class PresetError(ValueError):
    """No preset of that name for that family, or a preset that cannot be used where it was asked for."""


@dataclass(frozen=True)
class PromptPreset:
    """One benchmark's prompt for one family: ``template`` with ``{instruction}``, an optional ``system`` (its
    ``{screen_width}`` / ``{screen_height}`` filled with the model-input image's size), an assistant ``prefill`` the
    answer continues, what it asks for (``target``), how its answer is read (``answer``, a key of ``ANSWERS``) and
    where it comes from."""

    name: str
    family: str
    template: str
    target: str
    answer: str
    source: str
    system: str | None = None
    prefill: str = ""
    clean_query: bool = False  # whitespace collapsed and trailing periods dropped, as the source's loader does

    @property
    def video(self) -> bool:
        """Whether it asks about a clip (its records' query in ``meta.query``) rather than an image
        (``meta.instruction``)."""
        return self.target == "span"

    @property
    def meta_key(self) -> str:
        return QUERY_KEY if self.video else INSTRUCTION_KEY

    def user_text(self, instruction: str) -> str:
        if self.clean_query:  # TencentARC/TimeLens timelens/dataset/timelens_data.py parse_query (df35740, line 10)
            instruction = re.sub(r"\s+", " ", instruction).strip().strip(".").strip()
        return self.template.replace("{instruction}", instruction)

    def system_text(self, width: int, height: int) -> str | None:
        """The system prompt for an image the model sees at ``width`` x ``height`` (None: the template's default)."""
        if self.system is None:
            return None
        return self.system.replace("{screen_width}", str(width)).replace("{screen_height}", str(height))

    def read_answer(self, generated: str) -> tuple[str, str, str | None]:
        """(the answer as the model wrote it, prefill included; the answer as eval reads it; why it holds no
        coordinates, or None). A computer_use call becomes ``[{"point_2d": [x, y]}]`` (a 4-number coordinate: its
        centre, as the source scores it); an answer in words its first time pair as ``{"span": [start, end]}``; the
        other answers are read as they are."""
        raw = self.prefill + generated
        if self.answer == "event_text":
            pairs = event_time_pairs(raw)
            if not pairs:
                return raw, raw, "the answer holds no pair of times"
            return raw, json.dumps({"span": list(pairs[0])}), None
        if self.answer != "computer_use":
            return raw, raw, None
        point = computer_use_click(raw)
        if point is None:
            return raw, raw, "the answer holds no computer_use call with a 2- or 4-number coordinate"
        return raw, json.dumps([{"point_2d": point}]), None

    def record(self) -> dict[str, Any]:
        """What predict's settings record of the prompt (and eval --report prints)."""
        return {"preset": self.name, "family": self.family, "template": self.template, "system": self.system,
                "prefill": self.prefill, "answer": self.answer, "source": self.source,
                **({"clean_query": True} if self.clean_query else {})}


_QWEN3_NOTE = " Qwen3.5 has no published prompt of its own; it answers in Qwen3-VL's convention and takes this one."
_SOURCES = {
    "refcoco/qwen2_5_vl": "Qwen maintainers: Qwen2.5-VL's RefCOCO evaluation prompt, QwenLM/Qwen3-VL issue #991 "
                          "(reply of 2025-03-24); answers in model-input pixels",
    "refcoco/qwen3_vl": "Qwen maintainers: Qwen3-VL's RefCOCO / RefCOCO+ / RefCOCOg evaluation prompt, QwenLM/Qwen3-VL "
                        "issue #1721 (reply of 2025-10-31); answers relative 0-1000." + _QWEN3_NOTE,
    "refcoco/qwen2_vl": "community answer (not a Qwen maintainer) in QwenLM/Qwen3-VL (then Qwen2-VL) issue #536 "
                        "(2024-11-19); VLMEvalKit's RefCOCO asks the same sentence with the expression in <ref></ref> "
                        "tags; Qwen2-VL answers with box tokens, 0-1000",
    "screenspot/qwen2_vl": "ScreenSpot-Pro's own evaluation code, likaixin2000/ScreenSpot-Pro-GUI-Grounding "
                           "models/qwen2vl.py (bd8bbbb, line 89): box tokens 0-1000, the box's centre is the click",
    "screenspot/qwen2_5_vl": "ScreenSpot-Pro's own evaluation code, likaixin2000/ScreenSpot-Pro-GUI-Grounding "
                             "models/qwen2_5vl.py (bd8bbbb, lines 20-66 and 160): the Qwen2.5-VL cookbook's "
                             "computer_use tool as system prompt, the instruction as user text, the answer prefilled "
                             "to the left_click coordinate (model-input pixels)",
    "timelens": "TimeLens' own evaluation code, TencentARC/TimeLens evaluation/utils.py (df35740, lines 8-11, "
                "GROUNDER_PROMPT), with which its README's Qwen2.5-VL-7B-Instruct and Qwen3-VL-8B-Instruct numbers on "
                "Charades-, ActivityNet- and QVHighlights-TimeLens were measured; the query cleaned as "
                "timelens/dataset/timelens_data.py parse_query, the answer's first time pair read as "
                "timelens/utils.py extract_time reads it",
}


def _presets() -> dict[tuple[str, str], PromptPreset]:
    refcoco_qwen3 = 'Locate every object that matches the description "{instruction}" in the image. Report bbox ' \
                    'coordinates in JSON format.'
    table = [
        PromptPreset("refcoco", "qwen2_vl", "Please provide the bounding box coordinate of the region this sentence "
                     "describes: {instruction}", "box", "box_tokens", _SOURCES["refcoco/qwen2_vl"]),
        PromptPreset("refcoco", "qwen2_5_vl", "Locate {instruction} in this image and output the bbox coordinates in "
                     "JSON format.", "box", "json", _SOURCES["refcoco/qwen2_5_vl"]),
        PromptPreset("refcoco", "qwen3_vl", refcoco_qwen3, "box", "json", _SOURCES["refcoco/qwen3_vl"]),
        PromptPreset("refcoco", "qwen3_5", refcoco_qwen3, "box", "json", _SOURCES["refcoco/qwen3_vl"]),
        PromptPreset("screenspot", "qwen2_vl", 'Output the bounding box in the image corresponding to the '
                     'instruction "{instruction}" with grounding.', "box", "box_tokens",
                     _SOURCES["screenspot/qwen2_vl"]),
        PromptPreset("screenspot", "qwen2_5_vl", "{instruction}", "point", "computer_use",
                     _SOURCES["screenspot/qwen2_5_vl"], system=COMPUTER_USE_SYSTEM, prefill=COMPUTER_USE_PREFILL),
        *(PromptPreset("timelens", family, "Please find the visual event described by the sentence '{instruction}', "
                       "determining its starting and ending times. The format should be: 'The event happens in "
                       "<start time> - <end time> seconds'.", "span", "event_text", _SOURCES["timelens"],
                       clean_query=True) for family in ("qwen2_5_vl", "qwen3_vl")),
    ]
    return {(preset.name, preset.family): preset for preset in table}


PRESETS = _presets()
_NO_QWEN3_SCREENSPOT = ("ScreenSpot prompt is published (Qwen3-VL's evaluation code covers ODinW-13, MathVision, "
                        "RealWorldQA, VideoMME and MMMU; its GUI cookbook is a multi-step agent prompt, not a "
                        "grounding one)")
_NO_TIMELENS = "TimeLens measured Qwen2.5-VL-7B-Instruct and Qwen3-VL-8B-Instruct only"
_MISSING = {("screenspot", "qwen3_vl"): "no Qwen3-VL " + _NO_QWEN3_SCREENSPOT,
            ("screenspot", "qwen3_5"): "no Qwen3-VL or Qwen3.5 " + _NO_QWEN3_SCREENSPOT,
            ("timelens", "qwen2_vl"): _NO_TIMELENS, ("timelens", "qwen3_5"): _NO_TIMELENS}


def preset_for(name: str, family: str) -> PromptPreset:
    """The preset ``name`` for ``family``; PresetError naming why there is none and what there is."""
    if name not in PRESET_NAMES:
        raise PresetError(f"no prompt preset {name!r}; the presets are {', '.join(PRESET_NAMES)}")
    preset = PRESETS.get((name, family))
    if preset is None:
        others = sorted(f for n, f in PRESETS if n == name)
        why = _MISSING.get((name, family), "no source publishes one")
        raise PresetError(f"no {name!r} prompt preset for {family}: {why}. It exists for {', '.join(others)}; "
                          "give the prompt yourself (convert --prompt) and report it with your numbers")
    return preset


def computer_use_click(text: str) -> list[float] | None:
    """The click of the first ``<tool_call>`` in ``text``: its ``arguments.coordinate`` ([x, y], or a box's centre);
    None when there is no call, its JSON is malformed or repeats a key, or the coordinate is not 2 or 4 numbers."""
    start = text.find("<tool_call>")
    if start < 0:
        return None
    body = text[start + len("<tool_call>"):]
    end = body.find("</tool_call>")
    body = body[:end] if end >= 0 else body
    try:
        call = json_text.plain(json_text.loads(body[:body.rfind("}") + 1]))
    except ValueError:
        return None
    arguments = call.get("arguments") if isinstance(call, dict) else None
    coords = arguments.get("coordinate") if isinstance(arguments, dict) else None
    if not (isinstance(coords, list) and len(coords) in (2, 4)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in coords)):
        return None
    point = [coords[0] / 2 + coords[2] / 2, coords[1] / 2 + coords[3] / 2] if len(coords) == 4 else list(coords)
    return point if all(math.isfinite(v) for v in point) else None


_CLOCK = re.compile(r"\b(\d{1,2}:\d{2}:\d{2}(?:\.\d+)?|\d{1,2}:\d{2}(?:\.\d+)?)\b")
_RANGES = (re.compile(r"(\d+\.?\d*)\s*-\s*(\d+\.?\d*)"), re.compile(r"(\d+\.?\d*)\s+to\s+(\d+\.?\d*)"))
_NUMBER = re.compile(r"\b(\d+\.\d+|\d+)\b")


def event_time_pairs(text: str) -> list[tuple[float, float]]:
    """The (start, end) seconds pairs of an answer in words, as TimeLens' extract_time finds them (timelens/utils.py,
    df35740, lines 28-85): clock times (``01:02.5``, ``1:02:03``) paired in order; else ``a - b`` or ``a to b``
    pairs; else any numbers, paired in order. Pairs are kept as found (an inverted one scores 0)."""
    text = text.lower()
    clock = _CLOCK.findall(text)
    clock = clock[:len(clock) // 2 * 2]
    if clock:
        seconds = [sum(float(part) * 60 ** place for place, part in enumerate(reversed(t.split(":")))) for t in clock]
        return list(zip(seconds[::2], seconds[1::2]))
    for pattern in _RANGES:
        pairs = pattern.findall(text)
        if pairs:
            return [(float(start), float(end)) for start, end in pairs]
    numbers = [float(n) for n in _NUMBER.findall(text)]
    numbers = numbers[:len(numbers) // 2 * 2]
    return list(zip(numbers[::2], numbers[1::2]))
