"""Frame keys as users write them (issue 41, item 8): one rule (``frame.keys``) for the plugin after LF reads the
YAML, for ``qwenvl-prep``'s YAML reader and flags, and for the video policy. A value is the number LF would use, or
one error naming the key, the value and the fix."""

from __future__ import annotations

import argparse
import math

import pytest

from llamafactory_qwenvl_patch.frame.keys import FrameKeyError, frame_key
from llamafactory_qwenvl_patch.frame.video import VideoPolicy
from qwenvl_prep.commands.options import add_policy_flags, spec_from_args
from qwenvl_prep.lf.run_spec import spec_from_yaml

# (as written in the YAML, what the error must say besides the key)
REFUSED = [
    ('"50176"', "50176"),  # quoted: LF would stop at image_max_pixels < image_min_pixels (str < int)
    ('"50,176"', "50176"),
    ("50,176", "50176"),
    ("1280*28*28", "1003520"),
    ("null", "remove the key"),
    ("true", "whole number"),
    ("1000000.5", "whole number"),
    ("0", "> 0"),
    ("-50176", "> 0"),
    (".inf", "finite"),
    ("${image_min_pixels}", "whole number"),
    ("[50176]", "whole number"),
]


def write_yaml(tmp_path, **keys: str):
    path = tmp_path / "train.yaml"
    lines = ["model_name_or_path: Qwen/Qwen2.5-VL-7B-Instruct", "template: qwen2_vl", "qwenvl_patch: true",
             *(f"{key}: {value}" for key, value in keys.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("written, value", [("1e6", 1_000_000), ("1.5e6", 1_500_000), ("1003520", 1_003_520),
                                            ("1_003_520", 1_003_520), ("1.0e+6", 1_000_000), ("1003520.0", 1_003_520)])
def test_prep_reads_the_yaml_as_lf_does(tmp_path, written, value):
    """PyYAML reads ``1e6`` as the text '1e6' (``int()`` then failed); LF's OmegaConf reads the float 1e6."""
    spec = spec_from_yaml(write_yaml(tmp_path, image_min_pixels="3136", image_max_pixels=written))
    assert spec.stamp.policy.max_pixels == value and type(spec.stamp.policy.max_pixels) is int


@pytest.mark.parametrize("written, fix", REFUSED)
def test_prep_names_the_key_for_anything_else(tmp_path, written, fix):
    with pytest.raises(FrameKeyError, match="image_max_pixels") as info:
        spec_from_yaml(write_yaml(tmp_path, image_max_pixels=written))
    assert fix in str(info.value)


@pytest.mark.parametrize("key, written", [("video_min_pixels", '"4096"'), ("video_max_pixels", "null"),
                                          ("video_maxlen", "64.5"), ("video_fps", '"2"'), ("video_fps", "0"),
                                          ("video_fps", "true"), ("qwenvl_frame_list_fps", '"1"'),
                                          ("qwenvl_frame_list_fps", ".nan")])
def test_prep_names_each_video_key(tmp_path, key, written):
    with pytest.raises(FrameKeyError, match=key):
        spec_from_yaml(write_yaml(tmp_path, **{key: written}))


def test_prep_video_keys_as_lf_reads_them(tmp_path):
    spec = spec_from_yaml(write_yaml(tmp_path, video_max_pixels="1.6e4", video_maxlen="6.4e1", video_fps="1",
                                     qwenvl_frame_list_fps="null"))
    video = spec.stamp.video
    assert (video.max_pixels, video.max_frames, video.fps, spec.stamp.frame_list_fps) == (16000, 64, 1.0, 1.0)
    assert type(video.max_pixels) is int and type(video.max_frames) is int and type(video.fps) is float


def policy_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_policy_flags(parser)
    return parser.parse_args(list(flags))


def test_prep_flags_take_the_same_numbers():
    spec = spec_from_args(policy_args("--min-pixels", "3136", "--max-pixels", "1e6", "--video-max-pixels", "1.6e4",
                                      "--video-maxlen", "64"))
    assert (spec.stamp.policy.max_pixels, spec.stamp.video.max_pixels, spec.stamp.video.max_frames) == (
        1_000_000, 16000, 64)


@pytest.mark.parametrize("flag, text", [("--max-pixels", "50,176"), ("--max-pixels", "1280*28*28"),
                                        ("--min-pixels", "0"), ("--video-maxlen", "64.5")])
def test_prep_flags_name_the_flag(flag, text, capsys):
    with pytest.raises(SystemExit):
        policy_args("--min-pixels", "3136", "--max-pixels", "50176", flag, text)
    assert flag in capsys.readouterr().err


def test_video_policy_takes_the_rule():
    policy = VideoPolicy.from_lf_keys({"video_max_pixels": 1.6e4, "video_maxlen": 64.0}, 28, "seconds")
    assert (policy.max_pixels, policy.max_frames) == (16000, 64) and type(policy.max_frames) is int
    for bad in ({"video_max_pixels": "16000"}, {"video_maxlen": True}, {"video_fps": None}):
        with pytest.raises(FrameKeyError, match=next(iter(bad))):
            VideoPolicy.from_lf_keys(bad, 28, "seconds")


@pytest.mark.parametrize("key, value, expected", [("image_max_pixels", 1e6, 1_000_000), ("video_maxlen", 128, 128),
                                                  ("video_fps", 2, 2.0), ("qwenvl_frame_list_fps", 0.5, 0.5)])
def test_the_rule(key, value, expected):
    assert frame_key(key, value) == expected and type(frame_key(key, value)) is type(expected)


@pytest.mark.parametrize("key, value", [("image_max_pixels", "50176"), ("image_max_pixels", None),
                                        ("image_max_pixels", False), ("video_fps", math.inf),
                                        ("video_fps", -1.0), ("video_fps", "2.0")])
def test_the_rule_refuses(key, value):
    with pytest.raises(FrameKeyError, match=key):
        frame_key(key, value)


# --- the plugin: LF's own parser, in-process (the hook patches it on import) ------------------------------------

ARGS = {"model_name_or_path": "unused", "stage": "sft", "do_train": True, "output_dir": "unused",
        "dataset": "unused", "qwenvl_patch": True}


def lf_parse(**keys: object):
    from llamafactory.hparams.parser import _parse_train_args

    return _parse_train_args({**ARGS, **keys})[0]


def test_plugin_takes_what_omegaconf_read():
    """OmegaConf gives LF ``1e6`` as 1000000.0; the plugin hands LF the integer, as every reader of the frame."""
    model_args = lf_parse(image_max_pixels=1e6, video_maxlen=64.0, video_fps=1)
    assert model_args.image_max_pixels == 1_000_000 and type(model_args.image_max_pixels) is int
    assert type(model_args.video_maxlen) is int and type(model_args.video_fps) is float


@pytest.mark.parametrize("value", ["50176", "50,176", "1280*28*28", None, True, 0])
def test_plugin_names_the_key_before_lf_compares_it(value):
    """Stock LF stops in ``ModelArguments.__post_init__`` with ``TypeError: '<' not supported between instances of
    'str' and 'int'`` (or NoneType), naming no key."""
    with pytest.raises(FrameKeyError, match="image_max_pixels"):
        lf_parse(image_max_pixels=value)


def test_plugin_leaves_stock_runs_alone():
    model_args = lf_parse(qwenvl_patch=False, image_max_pixels=1e6)
    assert model_args.image_max_pixels == 1e6 and type(model_args.image_max_pixels) is float
