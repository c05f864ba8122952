"""The EAGLE-3 drafter: the model, its checkpoint formats and the pre-flight check of an export."""
