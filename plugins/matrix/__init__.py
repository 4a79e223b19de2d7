"""The matrix protocol plugin."""
