"""Hardware profiles: <id>.toml."""
