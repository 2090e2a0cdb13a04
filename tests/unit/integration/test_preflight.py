"""The training-start image check: cheap for good files, exact for truncated ones."""

from __future__ import annotations

import pytest
from helpers import save_image

from llamafactory_qwenvl_patch.image_io.images import ImageError
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.integration.preflight import check_image

POLICY = ResizePolicy(256 * 28 * 28, 1024 * 28 * 28)


def test_truncated_jpeg_caught_trailer_accepted(tmp_path):
    good = save_image(tmp_path / "good.jpg", 1200, 900, (10, 120, 30))
    data = good.read_bytes()
    trailer = tmp_path / "trailer.jpg"
    trailer.write_bytes(data + b"\x00" * 10000)  # vendor data after the end marker: still a valid image
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(data[: len(data) // 2])
    check_image(str(good), POLICY)
    check_image(str(trailer), POLICY)
    check_image({"bytes": data, "path": None}, POLICY)
    with pytest.raises(ImageError, match="truncated.jpg: .*truncated"):
        check_image(str(truncated), POLICY)


def test_png_corruption_and_missing(tmp_path):
    png = save_image(tmp_path / "a.png", 300, 200)
    broken = tmp_path / "broken.png"
    raw = bytearray(png.read_bytes())
    raw[60] ^= 0xFF  # flip a byte inside the image data: the chunk CRC no longer matches
    broken.write_bytes(bytes(raw))
    check_image(str(png), POLICY)
    with pytest.raises(ImageError, match="broken.png"):
        check_image(str(broken), POLICY)
    with pytest.raises(ImageError, match="file not found"):
        check_image(str(tmp_path / "nope.png"), POLICY)


def test_record_mistakes_are_named_before_the_model_loads(tiny_model, tmp_path):
    """Issue 41, class 7, through LF's real data pipeline (in-process, no model loaded): an ``<image>`` in an
    assistant turn (trained silently before), a tag count that differs from the images (a ``datasets.map``
    traceback naming no record) and a ``cutoff_len`` that cuts inside the image tokens (a "shape mismatch" mid-
    training) are each named by sample; a record whose text alone is truncated passes, and LF keeps exactly the
    tokens the check's rule says it keeps."""
    from helpers import lf_sft_dataset, save_image, train_config, write_sharegpt

    from llamafactory_qwenvl_patch.integration.preflight_records import DatasetRecordError

    image = str(save_image(tmp_path / "data" / "a.jpg", 320, 240))
    words = " word" * 400

    def record(user: str, answer: str = "[1, 2, 3, 4]", images: int = 1) -> dict:
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
                "images": [image] * images}

    good, text_cut = record("<image>Where?"), record("<image>Where?" + words)
    system = {**record("<image>Where?"), "system": "Be brief.<|im_end|>"}
    bad = [record("Where?<image>", "<image>[1, 2, 3, 4]", 2), record("<image><image>Where?"),
           record(words + "<image>Where?"),
           # issue 51, class 7: chat-template tokens as text (the collator died at step 1 naming no record)
           record("<image>Find <|image_pad|> it."), record("<image>Where?", "[1, 2, 3, 4]<|video_pad|>"), system]
    write_sharegpt(tmp_path / "data", "toy", [good, *bad, text_cut],
                   columns={"messages": "messages", "images": "images", "system": "system"})
    with pytest.raises(DatasetRecordError) as caught:
        lf_sft_dataset(tiny_model, tmp_path / "data", tmp_path / "out", cutoff_len=400)
    message = str(caught.value)
    assert message.startswith("6 record problem(s)"), message
    assert "sample 1 (" in message and "<image> in an assistant turn (message 1)" in message, message
    assert "sample 2 (" in message and "2 <image> tag(s) for 1 image(s)" in message, message
    assert "sample 3 (" in message and "cutoff_len 400 cuts inside its image tokens" in message, message
    assert "sample 4 (" in message and "'<|image_pad|>' written in message 0: a token of the model's chat" in message
    assert "sample 5 (" in message and "'<|video_pad|>' written in message 1" in message, message
    assert "sample 6 (" in message and "'<|im_end|>' written in the system prompt" in message, message
    assert "sample 0 (" not in message and "sample 7 (" not in message, message

    # a prompt-only stage (GRPO reads its prompts as LF's ppo stage does) checks the chat-template tokens too
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    write_sharegpt(tmp_path / "data", "toy", [good, record("<image>Find <|image_pad|> it.")])
    model_args, data_args, training_args, _, _ = get_train_args(train_config(
        tiny_model, tmp_path / "data", tmp_path / "grpo", preprocessing_num_workers=None))
    tokenizer = load_tokenizer(model_args)
    with pytest.raises(DatasetRecordError) as caught:
        get_dataset(get_template_and_fix_tokenizer(tokenizer["tokenizer"], data_args), model_args, data_args,
                    training_args, stage="ppo", **tokenizer)
    assert str(caught.value).startswith("1 record problem(s)")
    assert "sample 1 ('<image>Find <|image_pad|> it.'): '<|image_pad|>' written in message 0" in str(caught.value)

    write_sharegpt(tmp_path / "data", "toy", [good, text_cut])
    module, template, dataset = lf_sft_dataset(tiny_model, tmp_path / "data", tmp_path / "out", cutoff_len=400)
    pad = module["tokenizer"].convert_tokens_to_ids("<|image_pad|>")
    kept = dataset[1]["input_ids"]
    assert len(kept) == 400 and kept.count(pad) == dataset[0]["input_ids"].count(pad) > 100
