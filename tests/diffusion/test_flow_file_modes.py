"""The tiny flow model builder writes files the umask lets the team read (safetensors alone writes 0600)."""

from __future__ import annotations

import os
import stat

from grouprl.domains.diffusion.tiny import build_tiny_pixel_flow


def test_the_tiny_flow_builder_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        built = build_tiny_pixel_flow(tmp_path / "flow", seed=0, image_size=16)
    finally:
        os.umask(old)
    wrong = [f"{p.relative_to(built)}: {oct(stat.S_IMODE(p.stat().st_mode))}" for p in [built, *built.rglob("*")]
             if stat.S_IMODE(p.stat().st_mode) != (0o750 if p.is_dir() else 0o640)]
    assert not wrong
