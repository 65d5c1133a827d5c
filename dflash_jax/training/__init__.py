"""Training: the DFlash drafter against a frozen target (and the data, features and checkpoints it needs)."""
