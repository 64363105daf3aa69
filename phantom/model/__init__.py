"""The model a user holds: LoRA, PhantomModel over the executor, generation, checkpoints converted in and exported out."""
