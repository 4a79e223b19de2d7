"""The zulip protocol plugin."""
