"""A finetuning run: the loop, checkpoints, preference pairs, trackers, run cards, run files, RunConfig and run()."""
