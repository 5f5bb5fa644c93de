"""Exporter (placeholder)."""
