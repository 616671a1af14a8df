"""Inference engines behind Libra's buckets.

- `model_maker`: `libra make-model`, the tiny seeded Qwen2 model folder (default model).
- the embedded CPU server (`libra serve-engine`), the vLLM launcher and weight updates
  live in their own modules here; importing this package imports none of them.
"""
