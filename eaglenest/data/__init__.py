"""What goes in: the target's files, prompts, the target's responses, token streams and the draft
vocabulary."""
