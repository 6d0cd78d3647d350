"""`shoal bench` and `shoal tune`: load generation, knees, side-by-side baselines, tuned overlays."""
