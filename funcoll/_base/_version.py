"""funcoll's version, also in pyproject.toml: one place below every layer that reads it."""

__version__ = "0.1.0"
