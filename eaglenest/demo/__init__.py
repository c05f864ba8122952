"""The built-in demo: its arithmetic chat data and a tiny Kimi-style target built from a seed."""
