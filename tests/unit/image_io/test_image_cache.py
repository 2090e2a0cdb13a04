"""``qwenvl_image_cache_mb``: a model-input image made again from the store is the one ``model_input_image`` makes,
pixel for pixel; a file replaced or touched, another policy, or an input that is no file is made anew; the store
stays within its bytes, least recently used first out; and what the caller gets is its own copy."""

from __future__ import annotations

import os

import numpy as np
import pytest
from PIL import Image

from llamafactory_qwenvl_patch.frame.policy import ResizePolicy
from llamafactory_qwenvl_patch.image_io.image_cache import ImageCache
from llamafactory_qwenvl_patch.image_io.images import model_input_image

POLICY = ResizePolicy(32 * 28 * 28, 64 * 28 * 28, 28)


def photo(path, seed: int, size=(1170, 2532)):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path, quality=90)
    return str(path)


def counting():
    made = []

    def make(source, policy):
        made.append(source)
        return model_input_image(source, policy)

    return made, make


def test_a_stored_image_is_the_one_made_and_made_once(tmp_path):
    path = photo(tmp_path / "a.jpg", 0)
    made, make = counting()
    cache = ImageCache(64 << 20)
    first, again = cache.image(path, POLICY, make), cache.image({"path": path}, POLICY, make)
    assert made == [path] and (cache.hits, cache.misses) == (1, 1)
    fresh = model_input_image(path, POLICY)
    assert np.array_equal(np.asarray(again), np.asarray(fresh)) and again.size == fresh.size == first.size
    again.paste((0, 0, 0), (0, 0, again.width, again.height))  # the caller's copy: the store keeps its pixels
    assert np.array_equal(np.asarray(cache.image(path, POLICY, make)), np.asarray(fresh))


def test_a_changed_file_another_policy_or_no_file_is_made_anew(tmp_path):
    path = photo(tmp_path / "a.jpg", 0)
    made, make = counting()
    cache = ImageCache(64 << 20)
    cache.image(path, POLICY, make)
    photo(tmp_path / "b.jpg", 1)
    os.replace(tmp_path / "b.jpg", path)  # another file under the same name
    replaced = cache.image(path, POLICY, make)
    assert np.array_equal(np.asarray(replaced), np.asarray(model_input_image(path, POLICY)))
    os.utime(path, ns=(1, 1))  # touched
    cache.image(path, POLICY, make)
    cache.image(path, ResizePolicy(16 * 28 * 28, 32 * 28 * 28, 28), make)
    data = (tmp_path / "a.jpg").read_bytes()
    cache.image({"bytes": data, "path": path}, POLICY, make)
    cache.image({"bytes": data, "path": path}, POLICY, make)
    assert len(made) == 6 and cache.hits == 0


def test_the_store_keeps_to_its_bytes_least_recently_used_out(tmp_path):
    paths = [photo(tmp_path / f"{i}.jpg", i, (800, 600)) for i in range(3)]
    one = model_input_image(paths[0], POLICY)
    made, make = counting()
    cache = ImageCache(2 * one.width * one.height * 3)  # room for two
    for path in (paths[0], paths[1], paths[0], paths[2], paths[0], paths[1]):
        cache.image(path, POLICY, make)
    assert made == [paths[0], paths[1], paths[2], paths[1]] and cache.used <= cache.max_bytes
    off = ImageCache(0)
    off.image(paths[0], POLICY, make), off.image(paths[0], POLICY, make)
    assert made[-2:] == [paths[0], paths[0]] and off.used == 0


@pytest.mark.parametrize("value", [-1, 1.5, True, "512", 1 << 21])
def test_the_key_takes_whole_megabytes_only(value):
    from types import SimpleNamespace

    from llamafactory_qwenvl_patch.integration.model_patch import image_cache_mb_of

    with pytest.raises(ValueError, match="qwenvl_image_cache_mb must be a whole number of megabytes from 0 to"):
        image_cache_mb_of(SimpleNamespace(qwenvl_image_cache_mb=value))
    assert image_cache_mb_of(SimpleNamespace(qwenvl_image_cache_mb=512)) == 512
    assert image_cache_mb_of(SimpleNamespace()) == 0


def test_the_pinned_plugin_draws_from_its_process_store(tmp_path):
    """What the template patch installs: with ``qwenvl_image_cache_mb`` the plugin's still images come from the
    process store on a second draw, the same pixels; without, every draw is made."""
    from llamafactory.data.template import TEMPLATES

    from llamafactory_qwenvl_patch.frame.video import VideoPolicy
    from llamafactory_qwenvl_patch.image_io.image_cache import process_cache
    from llamafactory_qwenvl_patch.integration.plugin import pinned_plugin

    path = photo(tmp_path / "a.jpg", 3)
    video = VideoPolicy(2048, 12288, 28, 2.0, 16, "seconds")
    base = TEMPLATES["qwen2_vl"].mm_plugin
    cached = pinned_plugin(base, POLICY, video, 2.0, image_cache_mb=7)
    store = process_cache(7)
    hits = store.hits
    first, again = (cached._regularize_images([path])["images"][0] for _ in range(2))
    assert store.hits == hits + 1 and np.array_equal(np.asarray(first), np.asarray(again))
    plain = pinned_plugin(base, POLICY, video, 2.0)
    assert plain.qwenvl_image_cache_mb == 0 and process_cache(0).hits == 0
    assert np.array_equal(np.asarray(plain._regularize_images([path])["images"][0]), np.asarray(first))
