"""Multimodal input handling: media loading (media.py, video.py) and per-model processors."""
