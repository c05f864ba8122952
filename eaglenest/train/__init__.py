"""Training the drafter with training-time test: the loop, the loss, resuming and DDP launch."""
