"""engine — compute: MLX models, slots, aligned prefill, decode, plane export, restore."""
