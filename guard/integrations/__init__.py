"""Integrations with training frameworks; import the submodule you need (each imports its
framework): guard.integrations.transformers, guard.integrations.lightning."""

__all__: list[str] = []
