"""MXFP4 (OCP microscaling FP4) weights, as gpt-oss checkpoints store their experts: the plain-torch dequantization."""
