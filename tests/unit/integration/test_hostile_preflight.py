"""Hostile input for the training-start pre-flight (issue 11, class 9): corrupt GIF, TIFF, BMP, PNG and JPEG files
the old pre-flight passed are each caught by name, all of them in one report."""

from __future__ import annotations

from pathlib import Path

import pytest
from hostile import POLICY

from llamafactory_qwenvl_patch.image_io.images import ImageError


def _corrupt_images(tmp_path) -> dict[str, Path]:
    """Class 9: files the old pre-flight passed and the tokenizer then died on, one per training attempt."""
    import zlib

    from PIL import Image

    out = {}
    for fmt in ("gif", "tiff", "bmp"):
        good = tmp_path / f"good.{fmt}"
        Image.effect_noise((300, 200), 64).convert("RGB" if fmt != "gif" else "P").save(good)
        bad = tmp_path / f"truncated.{fmt}"
        bad.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
        out[fmt] = bad
    png = tmp_path / "good.png"
    Image.effect_noise((300, 200), 64).convert("RGB").save(png)
    raw = bytearray(png.read_bytes())
    i = raw.index(b"IDAT") - 4
    length = int.from_bytes(raw[i:i + 4], "big")
    body = bytearray(raw[i + 8:i + 8 + length])
    body[length // 2:length // 2 + 40] = bytes(40)  # damaged compressed data ...
    raw[i + 8:i + 8 + length] = body
    raw[i + 8 + length:i + 12 + length] = zlib.crc32(bytes(raw[i + 4:i + 8 + length])).to_bytes(4, "big")  # ... valid CRC
    out["png"] = tmp_path / "crc_ok.png"
    out["png"].write_bytes(bytes(raw))
    jpeg = tmp_path / "good.jpg"
    Image.effect_noise((300, 200), 64).convert("RGB").save(jpeg, quality=90)
    data = jpeg.read_bytes()
    comment = b"\xff\xfe\x00\x06\xff\xd9\x00\x00"  # a comment whose text holds an end-of-image marker
    sos = data.index(b"\xff\xda")
    out["jpg"] = tmp_path / "truncated_comment.jpg"
    out["jpg"].write_bytes(data[:sos] + comment + data[sos:sos + 600])
    return out


def test_preflight_catches_corrupt_files_of_every_format(tmp_path):
    from llamafactory_qwenvl_patch.integration.preflight import check_image

    for kind, path in _corrupt_images(tmp_path).items():
        with pytest.raises(ImageError, match=path.name):
            check_image(str(path), POLICY)
        assert (tmp_path / f"good.{kind}").exists()
        check_image(str(tmp_path / f"good.{kind}"), POLICY)


def test_preflight_reports_all_bad_files_at_once(tmp_path):
    import datasets

    from llamafactory_qwenvl_patch.integration.preflight import DatasetMediaError, check_dataset_media

    bad = [str(p) for p in _corrupt_images(tmp_path).values()]
    dataset = datasets.Dataset.from_dict({"_images": [[p] for p in bad + [str(tmp_path / "good.png")]],
                                          "_prompt": [[{"role": "user", "content": "Q"}]] * (len(bad) + 1)})
    with pytest.raises(DatasetMediaError, match=f"{len(bad)} image problem") as caught:
        check_dataset_media(dataset, POLICY)
    assert all(Path(p).name in str(caught.value) for p in bad)
