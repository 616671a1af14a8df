"""What the `libra train` tests share."""

TINY_MODEL = """[model]
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 2
max_position_embeddings = 1024
"""
"""The smallest model the train tests build (one layer of 64): a few seconds a step."""
