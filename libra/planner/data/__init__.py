"""Built-in profile data files (TOML, one per profile, each with a [sources] table)."""
