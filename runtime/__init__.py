"""Runtime (placeholder)."""
