"""Test helpers (tiny models, fixtures shared across test modules)."""
