"""The model a user holds: LoRA and its adapter files, PhantomModel over its blocks (resident or streamed), full finetuning's wiring, batched generation."""
