"""CPU-scale reproduction of the length-surge collapse and of the LR-decay fix."""
