"""loopspec.train: drafter training (imports loopspec core only)."""
