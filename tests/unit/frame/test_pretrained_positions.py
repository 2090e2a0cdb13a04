"""Issue 49, item 1: Qwen2-VL and Qwen2.5-VL positions as the models were pretrained. Text after a video starts at the
video's largest M-RoPE position + 1 (Qwen's own code, transformers 4.x to 5.2, vLLM), not at its start + max(h, w) /
merge (transformers 5.3 on). Checked against a reference written from Qwen's formula, vLLM 0.28's own
``get_mrope_input_positions`` and transformers' own ``get_rope_index`` (equal on images, different after videos)."""

from __future__ import annotations

import importlib.util
import inspect
from types import SimpleNamespace

import pytest
import torch
from packaging.version import Version

from llamafactory_qwenvl_patch.frame.mrope import pin_pretrained_positions, pretrained_rope_index

IMAGE, VIDEO, START, END, TEXT = 151655, 151656, 151652, 151653, 100
MERGE, TPS = 2, 2  # spatial merge size; Qwen2.5-VL's tokens_per_second


def prompt(*parts) -> tuple[list[int], list[str], list[list[int]]]:
    """Token ids of text runs (an int: that many tokens) and vision blocks (("image"|"video", (t, h, w))), with the
    blocks' modalities and grids in order."""
    ids, kinds, grids = [], [], []
    for part in parts:
        if isinstance(part, int):
            ids += [TEXT] * part
            continue
        kind, (t, h, w) = part
        ids += [START] + [IMAGE if kind == "image" else VIDEO] * (t * h * w // MERGE**2) + [END]
        kinds.append(kind)
        grids.append([t, h, w])
    return ids, kinds, grids


def qwen_reference(ids: list[int], kinds: list[str], grids: list[list[int]], seconds: list[float],
                   tps: float | None) -> list[list[int]]:
    """Qwen's formula as transformers 4.x wrote it: find each vision start, text from st_idx, the block at
    text_len + st_idx, st_idx = everything's max + 1."""
    out: list[list[int]] = [[], [], []]
    st, st_idx, videos = 0, 0, iter(seconds)
    for kind, (t, h, w) in zip(kinds, grids):
        pad = IMAGE if kind == "image" else VIDEO
        first = ids.index(pad, st)
        for i in range(first - st):
            for axis in range(3):
                out[axis].append(st_idx + i)
        scale = next(videos) * tps if kind == "video" and tps else 1.0
        text_len, gh, gw = first - st, h // MERGE, w // MERGE
        for g in range(t):
            for r in range(gh):
                for c in range(gw):
                    out[0].append(int(g * scale) + text_len + st_idx)
                    out[1].append(r + text_len + st_idx)
                    out[2].append(c + text_len + st_idx)
        st = first + t * gh * gw
        st_idx = max(max(axis) for axis in out) + 1
    for i in range(len(ids) - st):
        for axis in range(3):
            out[axis].append(st_idx + i)
    return out


def ours(ids, kinds, grids, seconds, tps, pad_left: int = 0):
    row = torch.tensor([[0] * pad_left + ids])
    types = torch.tensor([[0] * pad_left + [1 if i == IMAGE else 2 if i == VIDEO else 0 for i in ids]])
    mask = torch.tensor([[0] * pad_left + [1] * len(ids)])
    images = torch.tensor([g for k, g in zip(kinds, grids) if k == "image"]) if "image" in kinds else None
    videos = torch.tensor([g for k, g in zip(kinds, grids) if k == "video"]) if "video" in kinds else None
    return pretrained_rope_index(row, types, images, videos, torch.tensor(seconds) if seconds else None, mask, MERGE,
                                 tps)


CASES = {
    "a 10-s clip": [7, ("video", (10, 8, 12)), 5],
    "a 5-min clip": [3, ("video", (128, 4, 6)), 9],
    "two videos and an image": [4, ("video", (4, 4, 8)), 2, ("image", (1, 6, 4)), 3, ("video", (6, 8, 4)), 6],
    "a video in a later turn": [12, ("image", (1, 4, 4)), 20, ("video", (8, 4, 4)), 4],
    "images only": [5, ("image", (1, 8, 12)), 3, ("image", (1, 4, 6)), 2],
}
SECONDS = {"a 10-s clip": [1.0], "a 5-min clip": [3.0], "two videos and an image": [2.0, 1.0],
           "a video in a later turn": [4.0], "images only": []}


@pytest.mark.parametrize("tps", [TPS, None], ids=["qwen2_5_vl clock", "qwen2_vl clock"])
@pytest.mark.parametrize("case", CASES)
def test_positions_are_qwens_formula(case, tps):
    ids, kinds, grids = prompt(*CASES[case])
    positions, deltas = ours(ids, kinds, grids, SECONDS[case], tps, pad_left=3)
    assert positions[:, 0, 3:].tolist() == qwen_reference(ids, kinds, grids, SECONDS[case], tps)
    assert positions[:, 0, :3].eq(0).all()  # padding at 0, as transformers 5.x gives it
    assert int(deltas) == int(positions.max()) + 1 - len(ids)  # generation continues at the largest + 1


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (scripts/add_vllm.sh)")
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
@pytest.mark.parametrize("case", CASES)
def test_positions_are_vllms(case, family):
    """vLLM 0.28's own function, on the same ids and grids (its features duck-typed as its scheduler hands them)."""
    if family == "qwen2_5_vl":
        from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as VllmModel
    else:
        from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration as VllmModel
    tps = TPS if family == "qwen2_5_vl" else None
    ids, kinds, grids = prompt(*CASES[case])
    seconds, features, offset = iter(SECONDS[case]), [], 0
    for kind, grid in zip(kinds, grids):
        offset = ids.index(IMAGE if kind == "image" else VIDEO, offset)
        data = {f"{kind}_grid_thw": SimpleNamespace(data=torch.tensor(grid))}
        if kind == "video" and tps:
            data["second_per_grid_ts"] = SimpleNamespace(data=torch.tensor(next(seconds)))
        features.append(SimpleNamespace(modality=kind, data=data, mm_position=SimpleNamespace(offset=offset)))
        offset += grid[0] * grid[1] * grid[2] // MERGE**2
    vision = SimpleNamespace(spatial_merge_size=MERGE, **({"tokens_per_second": tps} if tps else {}))
    model = SimpleNamespace(config=SimpleNamespace(vision_config=vision))
    model.iter_mm_grid_thw = lambda mm: VllmModel.iter_mm_grid_thw(model, mm)
    theirs, delta = VllmModel.get_mrope_input_positions(model, ids, features)
    positions, deltas = ours(ids, kinds, grids, SECONDS[case] if tps else [], tps)
    assert positions[:, 0].tolist() == theirs.tolist() and int(deltas) == delta


@pytest.fixture(scope="module")
def inner_models(tiny_model, tiny_model_qwen2):
    """transformers' own inner models (random weights are enough: positions read the config)."""
    from transformers import AutoConfig, Qwen2_5_VLModel, Qwen2VLModel

    return {"qwen2_5_vl": Qwen2_5_VLModel(AutoConfig.from_pretrained(tiny_model)),
            "qwen2_vl": Qwen2VLModel(AutoConfig.from_pretrained(tiny_model_qwen2))}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_pinned_models_answer_the_pretrained_rule_and_images_are_unchanged(inner_models, family):
    import transformers

    model = inner_models[family]
    config = model.config
    own = type(model).get_rope_index.__get__(model)
    for case in CASES:
        ids, kinds, grids = prompt(*CASES[case])
        ids = [config.image_token_id if i == IMAGE else config.video_token_id if i == VIDEO else i for i in ids]
        row = torch.tensor([ids])
        types = (row == config.image_token_id).long() + 2 * (row == config.video_token_id).long()
        kwargs = dict(attention_mask=torch.ones_like(row))
        images = [g for k, g in zip(kinds, grids) if k == "image"]
        videos = [g for k, g in zip(kinds, grids) if k == "video"]
        if images:
            kwargs["image_grid_thw"] = torch.tensor(images)
        if videos:
            kwargs["video_grid_thw"] = torch.tensor(videos)
            if family == "qwen2_5_vl":
                kwargs["second_per_grid_ts"] = torch.tensor(SECONDS[case])
        takes_types = "mm_token_type_ids" in inspect.signature(own).parameters  # 5.x; 4.x finds the tokens itself
        before = own(row, types, **kwargs) if takes_types else own(row, **kwargs)
        if not pin_pretrained_positions(model):  # transformers 4.x: nothing pinned, the model keeps its own rule
            continue
        after = model.get_rope_index(row, mm_token_type_ids=types, **kwargs)
        del model.get_rope_index  # back to the class's for the next case
        reference = qwen_reference([IMAGE if i == config.image_token_id else VIDEO if i == config.video_token_id
                                    else i for i in ids], kinds, grids, SECONDS[case],
                                   config.vision_config.tokens_per_second if family == "qwen2_5_vl" else None)
        assert after[0][:, 0].tolist() == reference
        if not videos:  # images: both rules agree
            assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
        elif Version(transformers.__version__).release >= (5, 3):  # the releases we fix put it elsewhere
            assert not torch.equal(before[0], after[0])


def test_the_forward_and_generation_agree_on_the_first_answer_token():
    """Generation continues from the prompt's largest position + 1 (``deltas``), which is where the training forward
    puts the answer's first token: with transformers 5.6's own rule the two sat on two sides of a gap."""
    ids, kinds, grids = prompt(5, ("video", (20, 4, 4)), 6)
    answer = [TEXT] * 4
    full, _ = ours(ids + answer, kinds, grids, [2.0], TPS)
    _, deltas = ours(ids, kinds, grids, [2.0], TPS)
    assert int(full[0, 0, len(ids)]) == len(ids) + int(deltas)
    assert full[:, 0, len(ids):].tolist() == [[int(full.max()) - 3 + i for i in range(4)]] * 3


def test_nothing_to_pin_outside_qwen2_and_qwen2_5(tiny_model_qwen3):
    from transformers import AutoModelForImageTextToText

    assert pin_pretrained_positions(AutoModelForImageTextToText.from_pretrained(tiny_model_qwen3)) == 0
