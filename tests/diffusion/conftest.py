"""The diffusion tests' shared fixtures: tiny pixel-space flow models, built once per session.

The core fixtures (tasks, run helpers, torchrun) come from tests/conftest.py.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_pixel_flow(tmp_path_factory):
    """``tiny_pixel_flow(**options)``: the directory of the demo's pixel-space flow model
    (``grouprl.domains.diffusion.tiny.build_tiny_pixel_flow``), built once per session for each set of
    options. Tests only read it (``load_flow_model`` gives each its own copy)."""
    pytest.importorskip("diffusers")
    from grouprl.domains.diffusion.tiny import build_tiny_pixel_flow

    built = {}

    def get(**options):
        key = repr(sorted(options.items()))
        if key not in built:
            built[key] = build_tiny_pixel_flow(tmp_path_factory.mktemp("pixel_flow") / "model", **options)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_flow(tiny_pixel_flow):
    """The smallest flow model the trainer tests run: 8 x 8 pixels, one transformer layer."""
    return tiny_pixel_flow(image_size=8, num_layers=1, num_attention_heads=2, attention_head_dim=8, embed_dim=16)
