"""Blocks to the device and back: placement and its layout, free memory, host buffers, transfer, write-back, the block scheduler, the executor, per-block optimizer state."""
