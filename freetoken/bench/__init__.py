"""`ft bench`: synthetic real-shape models and the decode benchmark with its same-run baselines."""
