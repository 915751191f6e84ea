"""Wan2.1 text-to-video (diffusers' `WanPipeline` layout) in Flax."""
