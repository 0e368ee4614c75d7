"""freetoken: serve large Mixture-of-Experts models on one consumer GPU."""

__version__ = "0.1.0"
