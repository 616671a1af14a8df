"""Built-in tools, installed as `libra.tools` (ids in `libra.registry`)."""
