"""The plan: what the GPU stages of a run will cost (disk, memory, time), written before they start."""
