"""Expert offloading: routed experts live in host RAM; a byte-budgeted GPU cache holds the hot ones."""
