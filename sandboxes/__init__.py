"""Sandbox backends and image recipes, installed as `libra.sandboxes`."""
