"""A generated reply read as it streams: its text, stop strings, reasoning and tool calls (TextStream)."""
