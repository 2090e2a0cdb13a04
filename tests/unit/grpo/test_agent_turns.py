"""The token layout of a multi-turn trajectory (design/agents.md section 4): scripted actions (token ids) through
turns whose screenshots differ in size give exactly LF's ``encode_multiturn`` + pinned plugin ids of the same
conversation, the loss mask is exactly the actions with their stop tokens, each image gets the policy's pads; the
positions are the one-piece row's and compose across the root; the context rule; the training forward over a row
(explicit positions, logits only where actions are predicted) equals scoring each action by its own forward."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from llamafactory_qwenvl_patch.frame.families import FAMILIES, family_of_model
from llamafactory_qwenvl_patch.frame.mrope import pin_pretrained_positions, token_types
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from llamafactory_qwenvl_patch.grpo.algorithm.token_stats import row_logps_and_entropy
from llamafactory_qwenvl_patch.grpo.rollout.turn_forward import action_logps, next_position, row_positions
from llamafactory_qwenvl_patch.grpo.rollout.turn_forward import suffix_positions
from llamafactory_qwenvl_patch.grpo.rollout.turns import CONTEXT, LayoutError, TurnRenderer, append_observation, fits
from llamafactory_qwenvl_patch.grpo.rollout.types import Segment, Trajectory

FIXTURES = {"qwen2_5_vl": "tiny_model", "qwen3_vl": "tiny_model_qwen3", "qwen3_5": "tiny_model_qwen3_5"}
# (width, height): a phone, a portrait tablet, a desktop; small bounds keep the tiny models fast, so every screen is
# downscaled, each to another model frame
SCREENS = [(1170, 2532), (800, 1280), (1920, 1080)]
PROMPT = [{"role": "user", "content": "Open the settings and turn on dark mode."}]
ACTIONS = ['{"action": "click", "point_2d": [12, 30]}', '{"action": "type", "text": "dark"}', '{"action": "done"}']


def screenshot(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def renderer(model_dir, template_name: str | None = None) -> TurnRenderer:
    """LF's template of the family with its plugin pinned as the template patch pins it, the tokenizer and processor
    of the tiny model."""
    from llamafactory.data.template import TEMPLATES
    from llamafactory.extras.constants import IMAGE_PLACEHOLDER
    from transformers import AutoProcessor

    from llamafactory_qwenvl_patch.integration.plugin import pinned_plugin

    family = FAMILIES[family_of_model(model_dir)]
    policy = ResizePolicy(3136, 50176, family.factor)
    template = copy.copy(TEMPLATES[template_name or family.default_template])
    template.mm_plugin = pinned_plugin(template.mm_plugin, policy,
                                       VideoPolicy(2048, 12288, family.factor, 2.0, 16, family.video_clock), 2.0)
    processor = AutoProcessor.from_pretrained(model_dir)
    return TurnRenderer(template, processor.tokenizer, processor, policy, IMAGE_PLACEHOLDER)


def observation_text(turn: int) -> str:
    return f"Screen {turn} of 3: press Save."


def play(r: TurnRenderer, actions: list[tuple[int, ...]], shots: list[Image.Image]) -> tuple[Segment, Trajectory]:
    """The root, then each action's ids and the next screen's observation, as a rollout builds them."""
    root = r.root(PROMPT, shots[0], observation_text(1))
    trajectory = Trajectory()
    for turn, action in enumerate(actions, start=1):
        if turn > 1:
            stopped = actions[turn - 2][-1] == r.stop_id
            trajectory = trajectory.extended(r.observation(PROMPT, turn, shots[turn - 1], observation_text(turn),
                                                           stopped=stopped))
        trajectory = trajectory.extended(Segment("model", action))
    return root, trajectory


def lf_conversation(r: TurnRenderer, answers: list[str], shots: list[Image.Image]) -> list[int]:
    """LF's ids for the conversation in one piece: the plugin expands every screenshot, ``encode_multiturn`` encodes
    the turns with the answers as assistant messages."""
    messages = [{"role": "user", "content": PROMPT[0]["content"] + r.placeholder + observation_text(1)}]
    for turn, answer in enumerate(answers, start=1):
        if turn > 1:
            messages.append({"role": "user", "content": r.placeholder + observation_text(turn)})
        messages.append({"role": "assistant", "content": answer})
    messages = r.template.mm_plugin.process_messages(messages, shots, [], [], r.processor)
    return [token for prompt, answer in r.template.encode_multiturn(r.tokenizer, messages) for token in prompt + answer]


def pad_runs(ids: list[int], pad: int) -> list[int]:
    runs, count = [], 0
    for token in [*ids, -1]:
        if token == pad:
            count += 1
        elif count:
            runs, count = [*runs, count], 0
    return runs


@pytest.mark.parametrize("family", list(FIXTURES))
def test_a_trajectory_row_is_lfs_conversation_in_one_piece(request, family):
    """Three turns, three screen sizes: the row is LF's one-piece encoding (up to what its template puts after the
    last stop word, which no action samples), the mask picks exactly the action ids with their stop tokens (an action
    cut before its stop token gets it from the next observation, untrained), each screenshot has the policy's pads,
    and the positions are the one-piece row's, composing across the root and across any turn."""
    model_dir = request.getfixturevalue(FIXTURES[family])
    r = renderer(model_dir)
    tok = r.tokenizer
    shots = [screenshot(w, h, seed) for seed, (w, h) in enumerate(SCREENS)]
    actions = [tuple(tok.encode(text, add_special_tokens=False)) + (r.stop_id,) for text in ACTIONS]
    actions[1] = actions[1][:-1]  # cut at max_new_tokens: no stop token sampled
    root, trajectory = play(r, actions, shots)
    suffix, mask = trajectory.rows()
    row = [*root.ids, *suffix]
    mask = torch.tensor([0] * len(root.ids) + mask)

    one_piece = lf_conversation(r, ACTIONS, shots)
    tail = one_piece[len(row):]
    assert one_piece[:len(row)] == row and tail == tok.encode("\n", add_special_tokens=False)
    assert torch.tensor(row)[mask == 1].tolist() == [token for action in actions for token in action]
    assert [s.kind for s in trajectory.segments] == ["model", "env", "model", "env", "model"]
    assert trajectory.images == shots[1:] and root.images == (shots[0],)
    pad = tok.convert_tokens_to_ids(r.template.mm_plugin.image_token)
    expected = [r.policy.image_tokens(h, w) for w, h in SCREENS]
    assert pad_runs(row, pad) == expected
    frames = [r.policy.model_size(h, w) for w, h in SCREENS]
    assert len(set(frames)) == 3 and all(fh * fw < w * h for (fh, fw), (w, h) in zip(frames, SCREENS))  # downscaled

    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    pin_pretrained_positions(model)  # as the model patch loads Qwen2-VL / Qwen2.5-VL
    grids = r.template.mm_plugin.get_mm_inputs(shots, [], [], [3], [0], [0], [row], r.processor)["image_grid_thw"]
    ids = torch.tensor(row)
    whole = row_positions(model, ids, grids)
    assert torch.equal(whole, row_positions(model, torch.tensor(one_piece), grids)[:, :len(row)])
    # a screenshot advances M-RoPE by its merged grid's longer side, not by its tokens
    advance = sum(max(fh, fw) // r.policy.factor for fh, fw in frames)
    assert next_position(whole) == len(row) - sum(expected) + advance < len(row)
    # composition: the root's positions, then the rest's alone shifted by the root's largest + 1; at every turn
    cut, head = len(root.ids), 1  # tokens and screenshots before each cut
    for k, segment in enumerate(trajectory.segments):
        prefix = row_positions(model, ids[:cut], grids[:head])
        rest = suffix_positions(model, ids[cut:], grids[head:] if head < 3 else None, next_position(prefix))
        assert torch.equal(torch.cat([prefix, rest], dim=1), whole), (family, k)
        cut, head = cut + len(segment.ids), head + len(segment.images)


def test_sampled_ids_are_never_reencoded(tiny_model):
    """Actions enter as the ids the model sampled, even where decoding and encoding them would give other ids."""
    r = renderer(tiny_model)
    tok = r.tokenizer
    canonical = tok.encode(ACTIONS[0], add_special_tokens=False)
    split = tuple(t for piece in canonical for t in tok.encode(tok.decode([piece])[:1], add_special_tokens=False)
                  + tok.encode(tok.decode([piece])[1:], add_special_tokens=False)) + (r.stop_id,)
    assert tok.decode(split[:-1]) == ACTIONS[0] and list(split[:-1]) != canonical  # same text, other ids
    shots = [screenshot(w, h, seed) for seed, (w, h) in enumerate(SCREENS[:2])]
    second = tuple(tok.encode(ACTIONS[2], add_special_tokens=False)) + (r.stop_id,)
    _, trajectory = play(r, [split, second], shots)
    ids, mask = trajectory.rows()
    assert [t for t, m in zip(ids, mask) if m] == [*split, *second]
    assert trajectory.segments[0].ids == split


def test_templates_and_prompts_the_layout_cannot_render(tiny_model, tiny_model_qwen3):
    """A template that rewrites earlier turns (LF's ReasoningTemplate: qwen3_vl), a plugin pinned to another frame
    or not pinned, a prompt that is not a task's, an observation before turn 2: each a named LayoutError."""
    from llamafactory.data.template import TEMPLATES

    with pytest.raises(LayoutError, match=r"ReasoningTemplate.encode_multiturn.*qwen3_vl_nothink"):
        renderer(tiny_model_qwen3, "qwen3_vl")
    r = renderer(tiny_model)
    with pytest.raises(LayoutError, match="not pinned to the run's frame"):
        TurnRenderer(r.template, r.tokenizer, r.processor, ResizePolicy(3136, 100352, 28), r.placeholder)
    with pytest.raises(LayoutError, match="Qwen2VLPlugin.*not pinned"):
        TurnRenderer(TEMPLATES["qwen2_vl"], r.tokenizer, r.processor, r.policy, r.placeholder)
    shot = screenshot(64, 64, 0)
    with pytest.raises(LayoutError, match="ending with the user's"):
        r.root([*PROMPT, {"role": "assistant", "content": "ok"}], shot)
    with pytest.raises(LayoutError, match="come from the environment"):
        r.root([{"role": "user", "content": r.placeholder + "Find it."}], shot)
    with pytest.raises(LayoutError, match="start at turn 2"):
        r.observation(PROMPT, 1, shot)


def test_an_observation_that_would_pass_the_budget_ends_the_trajectory(tiny_model):
    """o_t's size is known before it is appended; one that fits (with room for the next action's stop token) enters
    whole, one token more ends the trajectory ``context`` without it: no screenshot without its tokens."""
    r = renderer(tiny_model)
    shots = [screenshot(w, h, seed) for seed, (w, h) in enumerate(SCREENS)]
    action = tuple(r.tokenizer.encode(ACTIONS[0], add_special_tokens=False)) + (r.stop_id,)
    root, trajectory = play(r, [action], shots)
    observation = r.observation(PROMPT, 2, shots[1], observation_text(2))
    assert len(observation.ids) > r.policy.image_tokens(1280, 800)  # the pads and the template's text
    exact = len(root.ids) + len(action) + len(observation.ids) + 1
    assert fits(root, trajectory, observation, exact) and not fits(root, trajectory, observation, exact - 1)
    assert not fits(root, trajectory, observation, exact, room=2)

    grown = append_observation(root, trajectory, observation, exact)
    assert grown.end is None and grown.segments[-1] == observation and grown.images == [shots[1]]
    assert grown.length == len(action) + len(observation.ids)
    over = append_observation(root, trajectory, observation, exact - 1)
    assert over.end == CONTEXT and over.segments == trajectory.segments and over.images == []
    assert over.rows() == trajectory.rows()
    with pytest.raises(ValueError, match="ended \\(context\\)"):
        over.extended(observation)


def action_rows(r: TurnRenderer, shots: list[Image.Image]) -> list[tuple[list[int], list[int], int]]:
    """Two trajectories of one task (other actions, other lengths): (row ids, loss mask, screenshots used)."""
    tok = r.tokenizer
    plays = [[ACTIONS[0], ACTIONS[1], ACTIONS[2]], ['{"action": "key", "key": "enter"}', ACTIONS[2]]]
    rows = []
    for answers in plays:
        actions = [tuple(tok.encode(text, add_special_tokens=False)) + (r.stop_id,) for text in answers]
        root, trajectory = play(r, actions, shots)
        ids, mask = trajectory.rows()
        rows.append(([*root.ids, *ids], [0] * len(root.ids) + mask, len(actions)))
    return rows


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_the_row_forward_equals_scoring_each_turn_alone(request, family):
    """Two right-padded trajectory rows in one forward (their images, explicit positions, logits only where an action
    token is predicted) give the log-probs and entropies of scoring each action by its own forward over its own
    prefix, the model computing that prefix's positions itself (1e-5). Token-index positions would not."""
    from transformers import AutoModelForImageTextToText

    model_dir = request.getfixturevalue(FIXTURES[family])
    r = renderer(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    pin_pretrained_positions(model)
    shots = [screenshot(w, h, seed) for seed, (w, h) in enumerate(SCREENS)]
    banned = torch.tensor([model.config.image_token_id])
    plugin = r.template.mm_plugin

    def vision(count: int) -> dict[str, torch.Tensor]:
        mm = plugin.get_mm_inputs(shots[:count], [], [], [count], [0], [0], [[]], r.processor)
        return {"pixel_values": mm["pixel_values"], "image_grid_thw": mm["image_grid_thw"]}

    rows = action_rows(r, shots)
    length = max(len(ids) for ids, _, _ in rows)
    pad = r.tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (length - len(ids)) for ids, _, _ in rows])
    loss_mask = torch.tensor([mask + [0] * (length - len(mask)) for _, mask, _ in rows])
    attention = torch.tensor([[1] * len(ids) + [0] * (length - len(ids)) for ids, _, _ in rows])
    pixels = [vision(count) for _, _, count in rows]
    positions = torch.zeros(3, 2, length, dtype=torch.long)
    for b, (ids, _, count) in enumerate(rows):
        positions[:, b, :len(ids)] = row_positions(model, torch.tensor(ids), pixels[b]["image_grid_thw"])
    inputs = {"input_ids": input_ids, "attention_mask": attention, "position_ids": positions,
              "pixel_values": torch.cat([p["pixel_values"] for p in pixels]),
              "image_grid_thw": torch.cat([p["image_grid_thw"] for p in pixels])}
    with torch.no_grad():
        packed = action_logps(model, inputs, loss_mask, banned, 0.7, entropy=True)
        predicting = sorted({i - 1 for _, mask, _ in rows for i, m in enumerate(mask) if m})
        assert packed.index.tolist() == predicting and packed.mask.sum() == loss_mask.sum()

        worst, naive_gap = 0.0, 0.0
        for b, (ids, mask, _) in enumerate(rows):
            got_logps = packed.logps[b][packed.mask[b] == 1]
            got_entropy = packed.entropy[b][packed.mask[b] == 1]
            want_logps, want_entropy = [], []
            starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
            for start in starts:  # each action: a forward over its own prefix and itself
                end = next((i for i in range(start, len(mask)) if not mask[i]), len(mask))
                prefix = torch.tensor([ids[:end]])
                images = int((prefix[0, :start] == model.config.vision_start_token_id).sum())
                logits = model(input_ids=prefix, mm_token_type_ids=token_types(prefix, model.config),
                               **vision(images)).logits[0, start - 1:end - 1]
                logp, entropy = row_logps_and_entropy(logits, prefix[0, start:end], banned, 0.7, entropy=True)
                want_logps.append(logp)
                want_entropy.append(entropy)
            worst = max(worst, float((got_logps - torch.cat(want_logps)).abs().max()),
                        float((got_entropy - torch.cat(want_entropy)).abs().max()))
            plain = dict(inputs, position_ids=torch.arange(length).expand(3, 2, length))
            naive = action_logps(model, plain, loss_mask, banned, 0.7).logps[b][packed.mask[b] == 1]
            naive_gap = max(naive_gap, float((naive - got_logps).abs().max()))
    print(f"{family}: max |d log p|, |d entropy| {worst:.1e}; token-index positions {naive_gap:.1e}")
    assert worst < 1e-5 and naive_gap > 1e-3
