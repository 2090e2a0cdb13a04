"""Hostile input for the frame core (issue 11): an image so thin that the policy's short side would round to
zero is a named policy error, never a ZeroDivisionError."""

from __future__ import annotations

import pytest
from helpers import save_image

from llamafactory_qwenvl_patch.frame.policy import PolicyError, ResizePolicy
from llamafactory_qwenvl_patch.image_io.images import ImageError
from llamafactory_qwenvl_patch.integration.preflight import check_image


def test_thin_image_under_small_bounds_is_a_policy_error(tmp_path):
    """29x5771 under max_pixels 50176: smart_resize floors the short side to 0 (was ZeroDivisionError in the core,
    which killed convert, check, draw and training alike)."""
    small = ResizePolicy(56 * 56, 50176)
    with pytest.raises(PolicyError, match="short side would be 0 px"):
        small.model_size(5771, 29)
    path = save_image(tmp_path / "thin.png", 29, 5771)
    with pytest.raises(ImageError, match="thin.png.*short side"):
        check_image(str(path), small)
