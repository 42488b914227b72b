"""loopspec.engines: what the runtime calls — engine specs and export wrappers."""
