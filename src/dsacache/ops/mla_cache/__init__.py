"""MLA latent cache write path: store a step's latents into one layer's MLA pages.

``api.py`` holds the public function, ``naive.py`` the PyTorch reference (also the CPU
path), ``store.py`` the Triton kernel and ``launch.py`` its launcher and configuration.
Entry formats: :mod:`dsacache.formats.mla_entry` and ``docs/formats.md``.
"""

from dsacache.ops.mla_cache.api import store_mla_latents

__all__ = ["store_mla_latents"]
