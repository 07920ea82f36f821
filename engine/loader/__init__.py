"""Loading model weights: the model source, safetensors reading (sharded for parallel ranks)."""
