"""A training run's spec (resize policy, family, template, datasets): read from the LF training YAML itself, or from
explicit flags."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from llamafactory_qwenvl_patch.frame.families import FAMILIES, LF_IMAGE_DEFAULTS, family_for_template, resolve_family
from llamafactory_qwenvl_patch.frame.keys import frame_key, frame_keys
from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.frame.stamp import Stamp
from llamafactory_qwenvl_patch.frame.video import VideoPolicy


@dataclass(frozen=True)
class RunSpec:
    """What a training run expects of its data: policy, model family, and the YAML facts that checks need. The stamp
    carries the run's video policy; a converted dataset's stamp carries it only when the dataset has videos."""

    stamp: Stamp
    template: str | None = None
    cutoff_len: int | None = None
    patched: bool = True
    datasets: tuple[str, ...] = ()
    dataset_dir: str | None = None


def load_yaml(path: str | os.PathLike) -> dict:
    """The training YAML as LLaMA-Factory reads it (``read_args``: OmegaConf, interpolations left as written), so
    that every value means here what it means in training: ``1e6`` is the float 1000000.0 there, where PyYAML reads
    the text '1e6'."""
    from omegaconf import DictConfig, OmegaConf

    try:
        config = OmegaConf.load(Path(path).absolute())
    except FileNotFoundError:
        raise ValueError(f"training YAML {path} not found") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"training YAML {path} does not parse: {exc}") from None
    except OSError as exc:  # also OmegaConf's "Invalid loaded object type: int" for a YAML that is one scalar
        raise ValueError(f"training YAML {path} cannot be read as a mapping of keys: {exc}") from None
    if not isinstance(config, DictConfig):
        raise ValueError(f"training YAML {path} is not a mapping of keys")
    return OmegaConf.to_container(config)


def _split(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else str(value).split(",")
    return tuple(str(v).strip() for v in items if str(v).strip())


def spec_from_yaml(path: str | os.PathLike, family: str | None = None) -> RunSpec:
    """Read ``image_min_pixels``, ``image_max_pixels``, ``template`` (and model family) from an LF YAML."""
    config = load_yaml(path)
    template = config.get("template")
    model = config.get("model_name_or_path")
    family = FAMILIES[family] if family else resolve_family(model, template)
    keys = frame_keys(config)
    bounds = {**LF_IMAGE_DEFAULTS, **keys}  # LF's defaults for the keys the YAML omits
    policy = ResizePolicy(bounds["image_min_pixels"], bounds["image_max_pixels"], family.factor)
    dataset_dir = config.get("dataset_dir", "data")
    if dataset_dir and not os.path.isabs(dataset_dir):
        dataset_dir = str(Path(path).resolve().parent / dataset_dir) if not Path(dataset_dir).exists() else dataset_dir
    video = VideoPolicy.from_lf_keys(keys, family.factor, family.video_clock)
    return RunSpec(
        stamp=Stamp(policy, family.coords, family.name, video=video,
                    frame_list_fps=frame_list_fps(keys.get("qwenvl_frame_list_fps"), video)),
        template=template,
        cutoff_len=int(config["cutoff_len"]) if "cutoff_len" in config else 2048,
        patched=bool(config.get("qwenvl_patch", False)),
        datasets=_split(config.get("dataset")) + _split(config.get("eval_dataset")),
        dataset_dir=dataset_dir,
    )


def spec_from_flags(min_pixels: int, max_pixels: int, family: str, video_keys: dict[str, object] | None = None
                    ) -> RunSpec:
    """The spec of explicit bounds; ``video_keys`` are LF's video keys (its defaults for those missing) and
    ``qwenvl_frame_list_fps``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(FAMILIES)}")
    f = FAMILIES[family]
    policy = ResizePolicy(min_pixels, max_pixels, f.factor)
    keys = video_keys or {}
    video = VideoPolicy.from_lf_keys(keys, f.factor, f.video_clock)
    return RunSpec(stamp=Stamp(policy, f.coords, family, video=video,
                               frame_list_fps=frame_list_fps(keys.get("qwenvl_frame_list_fps"), video)))


def frame_list_fps(value: object, video: VideoPolicy) -> float:
    """The rate a run reads frame lists at: ``qwenvl_frame_list_fps``, else ``video_fps`` (as the plugin does)."""
    return float(video.fps) if value is None else float(frame_key("qwenvl_frame_list_fps", value))


@functools.lru_cache(maxsize=None)
def template_problem(template: str | None) -> str | None:
    """Why ``qwenvl_patch: true`` training refuses this LF template (its plugin must be one of the families' plugins,
    ``Qwen2VLPlugin`` or ``Qwen3VLPlugin``), None when it accepts it. A template of a registered family is known;
    any other is looked up in LF's own registry (imported only then: it takes seconds)."""
    if template and family_for_template(template) is not None:
        return None
    if not template:
        return ("the YAML names no template: LLaMA-Factory would use the tokenizer's chat template without a Qwen-VL "
                "plugin, which qwenvl_patch refuses; set template: qwen2_vl (or qwen3_vl, ...)")
    try:
        from llamafactory.data.template import TEMPLATES
    except ImportError:
        return f"template {template!r} is not a Qwen-VL template this tool knows, and LLaMA-Factory is not installed"
    if template not in TEMPLATES:
        return f"template {template!r} does not exist in LLaMA-Factory"
    plugin = type(TEMPLATES[template].mm_plugin).__name__
    accepted = sorted({family.lf_plugin for family in FAMILIES.values()})
    if plugin not in accepted:
        return (f"template {template!r} uses LF's {plugin}; qwenvl_patch training accepts templates whose plugin is "
                f"{' or '.join(accepted)} (qwen2_vl, qwen3_vl, ...) and refuses this one")
    return None
