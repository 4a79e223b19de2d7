"""The simplex protocol plugin."""
