"""Model profiles: <id>.toml."""
