"""The status protocol plugin."""
