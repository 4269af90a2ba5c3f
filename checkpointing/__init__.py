"""checkpointing package."""
